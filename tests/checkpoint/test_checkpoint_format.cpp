// The file format: Shoal's files are torch.save files and the other way round, checked against
// Debian's PyTorch; unsafe, truncated and corrupt files are refused with clear errors.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "checkpoint/dcp_metadata.h"
#include "checkpoint/pickler.h"
#include "checkpoint/torch_save_writer.h"
#include "checkpoint/unpickler.h"

#include "checkpoint_testing.h"
#include "compat/torch_archive.h"
#include "shoal/checkpoint/dcp.h"
#include "shoal/checkpoint/serialization.h"
#include "shoal/checkpoint/sharded_checkpoint.h"
#include "shoal/checkpoint/training_state.h"
#include "shoal/error.h"
#include "testing/python.h"

namespace shoal::checkpoint {
namespace test_checkpoint_format {

using shoal::testing::compare_state_dicts;
using shoal::testing::make_net;

class CheckpointFormat : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = shoal::testing::temp_dir("ckpt-format"); }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }

  /// Expects `fn` to throw CheckpointError whose message contains every one of `parts`.
  template <typename Fn>
  void expect_error(Fn fn, std::initializer_list<std::string> parts) {
    try {
      fn();
      ADD_FAILURE() << "no CheckpointError";
    } catch (const CheckpointError& e) {
      for (const auto& part : parts) {
        EXPECT_NE(std::string(e.what()).find(part), std::string::npos)
            << "'" << part << "' not in: " << e.what();
      }
    }
  }

  std::string dir_;
};

TEST_F(CheckpointFormat, ValuesRoundTrip) {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
  dict.insert("int", int64_t{-5});
  dict.insert("big", int64_t{1} << 40);
  dict.insert("negbig", -(int64_t{1} << 40));
  dict.insert("u16", int64_t{40000});
  dict.insert("float", 0.1);
  dict.insert("true", true);
  dict.insert("none", c10::IValue());
  dict.insert("text", std::string("häfen"));
  dict.insert("tuple", c10::ivalue::Tuple::create({int64_t{1}, 2.5}));
  c10::impl::GenericList list(c10::AnyType::get());
  for (int64_t i = 0; i < 2500; ++i) list.push_back(i);  // more than one APPENDS batch
  dict.insert("list", list);
  dict.insert("half", at::arange(6, at::kHalf).reshape({2, 3}));
  dict.insert("view", at::arange(20, at::kDouble).reshape({4, 5}).t().slice(0, 1, 3));
  dict.insert("scalar", at::scalar_tensor(3, at::kLong));
  dict.insert("empty", at::empty({0, 3}));
  dict.insert("bool", at::tensor({1, 0}).to(at::kBool));
  save(dict, path("values.pt"));

  const auto back = load(path("values.pt")).toGenericDict();
  auto get = [&](const char* key) { return back.at(c10::IValue(std::string(key))); };
  EXPECT_EQ(get("int").toInt(), -5);
  EXPECT_EQ(get("big").toInt(), int64_t{1} << 40);
  EXPECT_EQ(get("negbig").toInt(), -(int64_t{1} << 40));
  EXPECT_EQ(get("u16").toInt(), 40000);
  EXPECT_EQ(get("float").toDouble(), 0.1);
  EXPECT_TRUE(get("true").toBool());
  EXPECT_TRUE(get("none").isNone());
  EXPECT_EQ(get("text").toStringRef(), "häfen");
  EXPECT_EQ(get("tuple").toTupleRef().elements()[1].toDouble(), 2.5);
  EXPECT_EQ(get("list").toListRef().size(), 2500u);
  EXPECT_EQ(get("list").toListRef()[2499].toInt(), 2499);
  for (const char* key : {"half", "view", "scalar", "empty", "bool"}) {
    const at::Tensor expected = dict.at(std::string(key)).toTensor();
    const at::Tensor actual = get(key).toTensor();
    EXPECT_EQ(actual.scalar_type(), expected.scalar_type()) << key;
    EXPECT_TRUE(actual.sizes() == expected.sizes() && at::equal(actual, expected)) << key;
  }
}

// A model with a child named "module" beside others (registered first, so that the first key
// has the prefix): torch_oracle.py builds the same one in Python.
struct ModuleChildImpl : torch::nn::Module {
  torch::nn::Linear module{register_module("module", torch::nn::Linear(3, 2))};
  torch::nn::Linear head{register_module("head", torch::nn::Linear(2, 2))};
};
TORCH_MODULE(ModuleChild);

TEST_F(CheckpointFormat, CrossesToPythonAndBack) {
  SHOAL_REQUIRE_PYTHON_TORCH();
  torch::manual_seed(0);
  auto net = make_net();
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  for (int i = 0; i < 3; ++i) {
    sgd.zero_grad();
    net->forward(torch::randn({5, 4})).pow(2).mean().backward();
    sgd.step();
  }
  TrainingState state = capture(*net, &sgd);
  state.epoch = 2;
  state.step = 3;
  // The trainer's configuration, numbers as numbers: Python must see float and int.
  state.config["model"] = std::string("mlp");
  state.config["lr"] = 0.05;
  state.config["momentum"] = 0.9;
  state.config["batch_size"] = int64_t{32};
  state.config["seed"] = int64_t{7};
  save_state_dict(state.model, path("shoal_sd.pt"));
  save_training_state(state, path("shoal_full.pt"));

  ASSERT_TRUE(shoal::testing::run_oracle("check_and_resave " + dir_ + " 2 3"));

  // Python's plain OrderedDict state dict, its full dict, and a DataParallel model's keys.
  for (const char* file : {"py_sd.pt", "py_full.pt", "py_dp.pt", "py_sd_p4.pt"}) {
    EXPECT_EQ(compare_state_dicts(load_state_dict_file(path(file)), state.model), "") << file;
  }
  const TrainingState ours = load_training_state(path("shoal_full.pt"));
  ASSERT_TRUE(ours.config.at("lr").isDouble() && ours.config.at("batch_size").isInt());
  EXPECT_EQ(ours.config.at("lr").toDouble(), 0.05);
  EXPECT_EQ(shoal::checkpoint::config_integer(ours, "seed", "shoal_full.pt"), 7);
  EXPECT_EQ(shoal::checkpoint::config_text(ours, "model"), "mlp");

  const TrainingState back = load_training_state(path("py_full.pt"));
  EXPECT_EQ(back.epoch, 2);
  // py_full.pt holds its config as strings, as Shoal's checkpoints did before: still read.
  ASSERT_TRUE(back.config.at("lr").isString());
  EXPECT_EQ(shoal::checkpoint::config_number(back, "lr", "py_full.pt"), 0.05);
  EXPECT_EQ(shoal::checkpoint::config_integer(back, "batch_size", "py_full.pt"), 32);
  // A seed above 2^63 (saved as unsigned text) comes back as the same 64 bits.
  EXPECT_EQ(static_cast<uint64_t>(*shoal::checkpoint::config_integer(back, "seed", "py_full.pt")),
            18446744073709551615ull);
  EXPECT_FALSE(shoal::checkpoint::config_number(back, "absent", "py_full.pt").has_value());
  EXPECT_THROW(shoal::checkpoint::config_number(back, "model", "py_full.pt"), shoal::CheckpointError);
  EXPECT_THROW(shoal::checkpoint::config_integer(back, "momentum", "py_full.pt"), shoal::CheckpointError);
  ASSERT_EQ(back.optimizer.param_groups.size(), 1u);
  EXPECT_EQ(back.optimizer.param_groups[0].options.at("lr").toDouble(), 0.05);
  ASSERT_EQ(back.optimizer.state.size(), state.optimizer.state.size());
  for (const auto& [index, buffers] : state.optimizer.state) {
    EXPECT_TRUE(at::equal(back.optimizer.state.at(index).at("momentum_buffer"), buffers.at("momentum_buffer")));
  }

  for (const char* file : {"py_values.pt", "py_values_p5.pt"}) {
    SCOPED_TRACE(file);
    const auto values = load(path(file)).toGenericDict();
    auto get = [&](const char* key) { return values.at(c10::IValue(std::string(key))); };
    const at::Tensor a = get("a").toTensor();
    EXPECT_TRUE(at::equal(a, at::arange(10, at::kDouble)));
    const at::Tensor b = get("b").toTensor();
    EXPECT_TRUE(at::equal(b, a.slice(0, 2, 5)));
    EXPECT_EQ(b.storage().data(), a.storage().data());  // views still share their storage
    EXPECT_TRUE(at::equal(get("c").toTensor(), a.view({2, 5}).t()));
    const auto size = get("size").toTupleRef().elements();
    ASSERT_EQ(size.size(), 2u);
    EXPECT_EQ(size[0].toInt(), 2);
    EXPECT_EQ(size[1].toInt(), 5);
    EXPECT_EQ(get("bytes").toStringRef(), std::string("\x00\xff" "ab", 4));
    EXPECT_EQ(get("betas").toTupleRef().elements()[1].toDouble(), 0.999);
    EXPECT_EQ(get("neg").toInt(), -3);
    EXPECT_EQ(get("big").toInt(), int64_t{1} << 40);
    EXPECT_EQ(get("negbig").toInt(), -(int64_t{1} << 40));
  }

  // PyTorch's names for a model with a child named "module" beside another stay as they are.
  const std::vector<std::string> child_names = {"module.weight", "module.bias", "head.weight",
                                                "head.bias"};
  const StateDict child_state = load_state_dict_file(path("py_module_child.pt"));
  EXPECT_EQ(child_state.keys(), child_names);
  ModuleChild child;
  EXPECT_TRUE(load_state_dict(*child, child_state).ok());
  EXPECT_EQ(shoal::checkpoint::state_dict(*child).keys(), child_names);

  // The DataParallel file loads straight into an unwrapped model.
  auto fresh = make_net();
  load_state_dict(*fresh, load_state_dict_file(path("py_dp.pt")));
  EXPECT_EQ(compare_state_dicts(shoal::checkpoint::state_dict(*fresh), state.model), "");

  // Adam state written by Python loads into LibTorch's Adam.
  const TrainingState adam_state = load_training_state(path("py_adam.pt"));
  EXPECT_EQ(adam_state.epoch, 7);
  torch::optim::Adam adam(fresh->parameters(), torch::optim::AdamOptions(0.5));
  restore(adam_state, *fresh, &adam);
  EXPECT_EQ(static_cast<torch::optim::AdamOptions&>(adam.param_groups()[0].options()).lr(), 0.01);
  const auto& first = static_cast<torch::optim::AdamParamState&>(
      *adam.state().begin()->second);
  EXPECT_EQ(first.step(), 2);
  EXPECT_TRUE(first.exp_avg().defined());

  // A pickle that would run os.system in Python is refused, and nothing ran.
  expect_error([&] { load(path("py_evil.pt")); },
               {path("py_evil.pt"), "system'", "which Shoal does not load"});
  EXPECT_FALSE(std::filesystem::exists(path("pwned")));
}

TEST_F(CheckpointFormat, RefusesGlobalsOutsideTheAllowList) {
  // A hand-made archive whose pickle calls os.system('touch ...').
  const std::string marker = path("pwned");
  const std::string command = "touch " + marker;
  std::string pickle = "\x80\x02" "cos\nsystem\n" "X";
  const uint32_t n = command.size();
  pickle.append(reinterpret_cast<const char*>(&n), 4);
  pickle += command + "\x85R.";
  {
    std::ofstream out(path("evil.pt"), std::ios::binary);
    compat::TorchArchiveWriter writer([&](const void* data, size_t size) {
      out.write(static_cast<const char*>(data), size);
      return size;
    });
    writer.write("data.pkl", pickle.data(), pickle.size());
    writer.finish();
  }
  expect_error([&] { load(path("evil.pt")); },
               {path("evil.pt"), "refers to 'os.system', which Shoal does not load: only tensors, "
                                 "containers and plain values are accepted"});
  EXPECT_FALSE(std::filesystem::exists(marker));
}

TEST_F(CheckpointFormat, TruncatedAndCorruptFilesNameTheFile) {
  torch::manual_seed(0);
  StateDict state;
  state.insert("w", torch::randn({256, 1024}));  // 1 MiB: most of the file is this tensor
  save_state_dict(state, path("good.pt"));
  const auto size = std::filesystem::file_size(path("good.pt"));
  std::string bytes(size, '\0');
  std::ifstream(path("good.pt"), std::ios::binary).read(bytes.data(), size);

  auto write = [&](const std::string& name, const std::string& content) {
    std::ofstream(path(name), std::ios::binary) << content;
    return path(name);
  };
  const std::string half = write("half.pt", bytes.substr(0, size / 2));
  expect_error([&] { load(half); }, {half, "truncated or corrupt"});
  const std::string tiny = write("tiny.pt", bytes.substr(0, 10));
  expect_error([&] { load(tiny); }, {tiny, "truncated or corrupt"});
  const std::string empty = write("empty.pt", "");
  expect_error([&] { load(empty); }, {empty});

  std::string flipped = bytes;
  flipped[size / 2] ^= 0x40;
  const std::string corrupt = write("corrupt.pt", flipped);
  expect_error([&] { load(corrupt); }, {corrupt, "record 'data/0' fails its checksum"});

  const std::string text = write("text.pt", "hello, this is not a checkpoint");
  expect_error([&] { load(text); }, {text, "not a torch.save file"});
  expect_error([&] { load(path("missing.pt")); }, {path("missing.pt"), "cannot open"});

  // The intact file still loads.
  EXPECT_EQ(compare_state_dicts(load_state_dict_file(path("good.pt")), state), "");
}

TEST_F(CheckpointFormat, DamagedPicklesFailCleanly) {
  // Random byte changes in a real pickle either still load or throw CheckpointError: never a crash,
  // a hang or another exception type.
  StateDict state;
  state.insert("a.weight", torch::ones({3, 4}));
  state.insert("a.bias", torch::zeros({3}));
  c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
  dict.insert("model", state_dict_to_ivalue(state));
  dict.insert("epoch", int64_t{3});
  dict.insert("betas", c10::ivalue::Tuple::create({0.9, 0.999}));
  detail::Pickler pickler;
  const std::string pickle = pickler.dump(dict);
  auto load_storage = [&](const std::string& key, c10::ScalarType dtype, int64_t numel) {
    if (numel > 1000) SHOAL_THROW(CheckpointError, "storage too large");
    return at::zeros({numel}, at::TensorOptions().dtype(dtype));
  };
  detail::Unpickler intact(pickle, load_storage, "test");
  EXPECT_TRUE(intact.load().isGenericDict());

  std::mt19937 random(12345);
  int refused = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    std::string damaged = pickle;
    const int changes = 1 + trial % 3;
    for (int c = 0; c < changes; ++c) {
      damaged[random() % damaged.size()] = static_cast<char>(random() % 256);
    }
    if (trial % 7 == 0) damaged.resize(random() % damaged.size());
    try {
      detail::Unpickler(damaged, load_storage, "test").load();
    } catch (const CheckpointError&) {
      ++refused;
    }
  }
  EXPECT_GT(refused, 100);
}

TEST_F(CheckpointFormat, StrictAndNonStrictLoading) {
  auto net = make_net();
  StateDict state = shoal::checkpoint::state_dict(*net);
  StateDict changed;
  for (const auto& item : state) {
    if (item.key() != "3.bias") changed.insert(item.key(), item.value().clone());
  }
  changed.insert("extra.weight", torch::zeros({2}));

  try {
    load_state_dict(*net, changed, /*strict=*/true);
    ADD_FAILURE() << "strict load accepted a missing and an unexpected key";
  } catch (const CheckpointError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("Missing key(s) in state_dict: \"3.bias\""), std::string::npos) << what;
    EXPECT_NE(what.find("Unexpected key(s) in state_dict: \"extra.weight\""), std::string::npos) << what;
  }
  changed["0.weight"].fill_(0.25);
  const auto result = load_state_dict(*net, changed, /*strict=*/false);
  EXPECT_EQ(result.missing_keys, std::vector<std::string>{"3.bias"});
  EXPECT_EQ(result.unexpected_keys, std::vector<std::string>{"extra.weight"});
  EXPECT_TRUE(at::equal(net->named_parameters()["0.weight"], torch::full({8, 4}, 0.25)));

  // A shape mismatch is an error even when not strict, as in PyTorch.
  changed["3.weight"] = torch::zeros({5, 8});
  try {
    load_state_dict(*net, changed, /*strict=*/false);
    ADD_FAILURE() << "a shape mismatch was accepted";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("size mismatch for 3.weight: copying a param with shape "
                                         "[5, 8] from checkpoint, the shape in current model is [3, 8]"),
              std::string::npos)
        << e.what();
  }

  // A "module." prefix (DataParallel/DDP) on every key is removed.
  auto other = make_net();
  load_state_dict(*other, add_prefix(state, "module."));
  EXPECT_EQ(compare_state_dicts(shoal::checkpoint::state_dict(*other), state), "");
}

// ModuleChild's names are its own, as PyTorch's state_dict() gives them, and no step of saving,
// reading or loading strips "module." from them. Only a prefix on every key is a wrapper's.
TEST_F(CheckpointFormat, ModulePrefixOnSomeKeysOnlyIsKept) {
  auto one = [](std::initializer_list<const char*> keys) {
    StateDict state;
    for (const char* key : keys) state.insert(key, torch::zeros({1}));
    return state;
  };
  EXPECT_FALSE(all_keys_have_prefix(one({"module.weight", "head.weight"}), kWrapperPrefix));
  EXPECT_FALSE(all_keys_have_prefix(one({"head.weight", "module.weight"}), kWrapperPrefix));
  EXPECT_FALSE(all_keys_have_prefix(one({"module.a", "module.b", "c"}), kWrapperPrefix));
  EXPECT_TRUE(all_keys_have_prefix(one({"module.a", "module.b", "module.c"}), kWrapperPrefix));
  EXPECT_FALSE(all_keys_have_prefix(one({}), kWrapperPrefix));

  const std::vector<std::string> names = {"module.weight", "module.bias", "head.weight", "head.bias"};
  ModuleChild model;
  const StateDict state = shoal::checkpoint::state_dict(*model);
  EXPECT_EQ(state.keys(), names);

  // Written and read back (torch.save format), the names stay.
  save_state_dict(state, path("module_child.pt"));
  EXPECT_EQ(load_state_dict_file(path("module_child.pt")).keys(), names);
  save_training_state(capture(*model, nullptr), path("module_child_full.pt"));
  EXPECT_EQ(load_training_state(path("module_child_full.pt")).model.keys(), names);

  // Loaded strictly into a fresh model: every value lands under its own name.
  ModuleChild fresh;
  {
    torch::NoGradGuard no_grad;
    for (auto& p : fresh->parameters()) p.fill_(7);
  }
  const auto result = load_state_dict(*fresh, load_state_dict_file(path("module_child.pt")));
  EXPECT_TRUE(result.ok());
  EXPECT_EQ(compare_state_dicts(shoal::checkpoint::state_dict(*fresh), state), "");

  // The same model wrapped (every key "module."-prefixed, as DDP saves it) loads too.
  ModuleChild unwrapped;
  load_state_dict(*unwrapped, add_prefix(state, kWrapperPrefix));
  EXPECT_EQ(compare_state_dicts(shoal::checkpoint::state_dict(*unwrapped), state), "");

  // strip_prefix removes it where it is; all_keys_have_prefix decides whether to call it.
  EXPECT_EQ(strip_prefix(state, kWrapperPrefix).keys(),
            (std::vector<std::string>{"weight", "bias", "head.weight", "head.bias"}));
}

TEST_F(CheckpointFormat, StateDictMatchesPythonOrder) {
  auto net = make_net();
  const auto keys = shoal::checkpoint::state_dict(*net).keys();
  const std::vector<std::string> expected = {
      "0.weight",        "0.bias",         "1.weight", "1.bias", "1.running_mean",
      "1.running_var",   "1.num_batches_tracked", "3.weight", "3.bias"};
  EXPECT_EQ(keys, expected);
}

// A DCP folder Shoal writes is what PyTorch 2.x's torch.distributed.checkpoint.load reads: every
// tensor equal, bit for bit and in dtype, to the same state dict saved with torch.save.
TEST_F(CheckpointFormat, DcpFolderLoadsIntoPyTorchsStateDict) {
  const std::string python = shoal::testing::torch2_python();
  if (python.empty()) GTEST_SKIP() << "PyTorch 2.x not installed (scripts/setup_torch_pypi.sh)";
  auto net = make_net();
  StateDict state = shoal::checkpoint::state_dict(*net);
  state.insert("extra.bf16", torch::randn({3, 5}).to(torch::kBFloat16));
  state.insert("extra.f64", torch::randn({7}, torch::kFloat64));
  state.insert("extra.steps", torch::tensor(int64_t{12345}));
  state.insert("extra.view", torch::arange(24, torch::kFloat32).view({4, 6}).t());  // not contiguous
  save_state_dict(state, path("reference.pt"));
  save_dcp(state, path("dcp"));
  const std::string code =
      "import sys, warnings\n"
      "warnings.filterwarnings('ignore')\n"
      "import torch, torch.distributed.checkpoint as dcp\n"
      "ref = torch.load(sys.argv[1])\n"
      "sd = {k: torch.zeros_like(v) for k, v in ref.items()}\n"
      "dcp.load(sd, checkpoint_id=sys.argv[2])\n"
      "for k, v in ref.items():\n"
      "    assert sd[k].dtype == v.dtype and torch.equal(sd[k], v), (k, sd[k], v)\n"
      "print('ORACLE OK', len(ref), 'tensors')\n";
  std::ofstream(path("oracle.py")) << code;
  const auto result = shoal::testing::run_command(python + " " + path("oracle.py") + " " +
                                                  path("reference.pt") + " " + path("dcp"));
  EXPECT_TRUE(shoal::testing::oracle_succeeded(result));

  // A folder that holds anything is refused, and what it holds stays.
  std::filesystem::create_directories(path("full"));
  std::ofstream(path("full/keep.txt")) << "mine";
  expect_error([&] { save_dcp(state, path("full")); }, {path("full"), "is not empty"});
  EXPECT_TRUE(std::filesystem::exists(path("full/keep.txt")));
}

// save_dcp → load_dcp gives back every tensor, bit for bit and in dtype (views, 0-d and empty
// tensors included); damaged folders are refused naming the file.
TEST_F(CheckpointFormat, DcpRoundTripAndDamagedFolders) {
  auto net = make_net();
  StateDict state = shoal::checkpoint::state_dict(*net);
  state.insert("extra.bf16", torch::randn({3, 5}).to(torch::kBFloat16));
  state.insert("extra.steps", torch::tensor(int64_t{12345}));
  state.insert("extra.view", torch::arange(24, torch::kFloat32).view({4, 6}).t());
  state.insert("extra.empty", torch::empty({0, 3}));
  save_dcp(state, path("dcp"));
  ASSERT_TRUE(is_dcp_folder(path("dcp")));
  EXPECT_FALSE(is_dcp_folder(dir_));
  const DcpContents back = load_dcp(path("dcp"));
  EXPECT_EQ(shoal::testing::compare_state_dicts(back.tensors, state), "");
  EXPECT_TRUE(back.skipped.empty());

  // The last tensor's bytes cut short: refused before anything is read, naming the data file.
  std::filesystem::copy(path("dcp"), path("short"));
  const std::string data = path("short/__0_0.distcp");
  std::filesystem::resize_file(data, std::filesystem::file_size(data) - 10);
  expect_error([&] { load_dcp(path("short")); }, {data, "lie beyond the end of the file", "truncated"});
  // Without .metadata (a save cut short) there is no checkpoint.
  std::filesystem::copy(path("dcp"), path("headless"));
  std::filesystem::remove(path("headless/.metadata"));
  expect_error([&] { load_dcp(path("headless")); }, {path("headless/.metadata"), "file not found"});

  // A plain state dict whose model has a child named "model" keeps every tensor; one saved as
  // {"model": ..., "optim": ...} gives its model's without the prefix.
  StateDict child;
  child.insert("model.weight", torch::ones({2}));
  child.insert("head.bias", torch::zeros({3}));
  save_dcp(child, path("child"));
  EXPECT_EQ(shoal::testing::compare_state_dicts(load_state_dict_file(path("child")), child), "");
  StateDict wrapped;
  wrapped.insert("model.weight", torch::ones({2}));
  wrapped.insert("optim.state.weight.step", torch::tensor(3.0F));
  save_dcp(wrapped, path("wrapped"));
  const StateDict model = load_state_dict_file(path("wrapped"));
  ASSERT_EQ(model.size(), 1U);
  EXPECT_NE(model.find("weight"), nullptr);
}

// A DCP folder as dcp.save writes get_state_dict's {"model": ..., "optim": ...}: `tensors` by
// their flattened keys, and param_groups `groups` (each its parameters' names and weight_decay).
void save_optimizer_dcp(const StateDict& tensors, const std::vector<std::pair<std::vector<std::string>, double>>& groups,
                        const std::string& folder) {
  std::filesystem::create_directories(folder);
  const std::string file = "__0_0.distcp";
  std::ofstream data(folder + "/" + file, std::ios::binary);
  int64_t written = 0;
  auto sink = [&](const void* bytes, size_t size) {
    data.write(static_cast<const char*>(bytes), static_cast<std::streamsize>(size));
    written += static_cast<int64_t>(size);
    return size;
  };
  std::vector<detail::DcpEntry> entries;
  auto add = [&](const std::string& fqn, const c10::IValue& value, detail::DcpEntry entry) {
    const int64_t start = written;
    detail::write_torch_save(value, sink, folder);
    entry.fqn = fqn;
    entry.chunks.push_back({std::vector<int64_t>(entry.size.size(), 0), entry.size, file, start, written - start});
    entries.push_back(std::move(entry));
  };
  for (const auto& item : tensors) {
    add(item.key(), item.value(), {{}, {item.key()}, false, item.value().scalar_type(), item.value().sizes().vec(), {}});
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    const std::string prefix = "optim.param_groups." + std::to_string(g) + ".";
    const auto index = static_cast<int64_t>(g);
    add(prefix + "params", c10::List<std::string>(groups[g].first), {{}, {"optim", "param_groups", index, "params"}, true});
    add(prefix + "lr", 0.01, {{}, {"optim", "param_groups", index, "lr"}, true});
    add(prefix + "weight_decay", groups[g].second, {{}, {"optim", "param_groups", index, "weight_decay"}, true});
  }
  data.close();
  std::ofstream(folder + "/.metadata", std::ios::binary) << detail::dcp_metadata_pickle(entries);
}

// A PyTorch optimizer's state goes to the model's parameter of its name, whatever order the
// PyTorch model registered them in; its param_groups are read group after group and merged
// where their options agree. A name or shape that does not match, or groups that differ, are
// refused naming them.
TEST_F(CheckpointFormat, ForeignDcpOptimizerMatchesByNameAndMergesGroups) {
  StateDict model;  // the model's named parameters, in its (and its optimizer's) order
  model.insert("a.weight", torch::zeros({2, 3}));
  model.insert("b.weight", torch::zeros({2, 3}));
  model.insert("c.bias", torch::zeros({4}));
  StateDict saved;
  for (const auto& item : model) saved.insert("model." + item.key(), item.value());
  saved.insert("optim.state.b.weight.exp_avg", torch::full({2, 3}, 2.0));
  saved.insert("optim.state.a.weight.exp_avg", torch::full({2, 3}, 1.0));
  saved.insert("optim.state.c.bias.exp_avg", torch::full({4}, 3.0));
  // Registered b, a, c in PyTorch, in two groups that agree.
  save_optimizer_dcp(saved, {{{"b.weight", "a.weight"}, 0.0}, {{"c.bias"}, 0.0}}, path("two"));
  const TrainingState in_order = load_foreign_dcp(path("two"));
  ASSERT_EQ(in_order.optimizer.state.size(), 3U);
  ASSERT_EQ(in_order.optimizer.param_groups.size(), 1U);
  EXPECT_EQ(in_order.optimizer.param_groups[0].params.size(), 3U);
  const TrainingState by_name = load_foreign_dcp_for(path("two"), model);
  ASSERT_EQ(by_name.optimizer.state.size(), 3U);
  for (int64_t i = 0; i < 3; ++i) {
    EXPECT_EQ(by_name.optimizer.state.at(i).at("exp_avg").flatten()[0].item<double>(), static_cast<double>(i + 1)) << i;
  }
  // Groups that differ (nanoGPT's decay / no-decay split) are refused naming both and the option.
  save_optimizer_dcp(saved, {{{"b.weight", "a.weight"}, 0.1}, {{"c.bias"}, 0.0}}, path("split"));
  expect_error([&] { load_foreign_dcp_for(path("split"), model); },
               {path("split/.metadata"), "param_groups 0 and 1 differ in weight_decay"});
  // A parameter the checkpoint lacks, one the model lacks, a shape that differs.
  StateDict other = model;
  other.insert("d.bias", torch::zeros({1}));
  expect_error([&] { load_foreign_dcp_for(path("two"), other); }, {"do not list the model's parameter 'd.bias'"});
  StateDict fewer;
  fewer.insert("a.weight", torch::zeros({2, 3}));
  fewer.insert("b.weight", torch::zeros({2, 3}));
  expect_error([&] { load_foreign_dcp_for(path("two"), fewer); }, {"'c.bias' is no parameter of this model"});
  StateDict reshaped = model;
  reshaped["c.bias"] = torch::zeros({5});
  expect_error([&] { load_foreign_dcp_for(path("two"), reshaped); },
               {"'optim.state.c.bias.exp_avg' has shape [4]", "'c.bias' has [5]"});
}

// DCP folders PyTorch 2.x's dcp.save wrote, once for the suite (dcp_oracle.py says what each is).
class DcpFromPyTorch : public CheckpointFormat {
 protected:
  static void SetUpTestSuite() {
    const std::string python = shoal::testing::torch2_python();
    if (python.empty()) return;
    oracle_dir_ = new std::string(shoal::testing::temp_dir("dcp-oracle"));
    const char* source = std::getenv("SHOAL_SOURCE_DIR");
    const std::string script = std::string(source ? source : ".") + "/tests/checkpoint/dcp_oracle.py";
    result_ = new shoal::testing::PythonResult(shoal::testing::run_command(python + " " + script + " " + *oracle_dir_));
  }
  static void TearDownTestSuite() {
    if (oracle_dir_ != nullptr) std::filesystem::remove_all(*oracle_dir_);
    delete oracle_dir_;
    delete result_;
    oracle_dir_ = nullptr;
    result_ = nullptr;
  }
  void SetUp() override {
    CheckpointFormat::SetUp();
    if (oracle_dir_ == nullptr) GTEST_SKIP() << "PyTorch 2.x not installed (scripts/setup_torch_pypi.sh)";
    ASSERT_TRUE(shoal::testing::oracle_succeeded(*result_));
  }
  static std::string oracle(const std::string& name) { return *oracle_dir_ + "/" + name; }

  static std::string* oracle_dir_;
  static shoal::testing::PythonResult* result_;
};
std::string* DcpFromPyTorch::oracle_dir_ = nullptr;
shoal::testing::PythonResult* DcpFromPyTorch::result_ = nullptr;

TEST_F(DcpFromPyTorch, PlainModelLoadsBitForBit) {
  const DcpContents dcp = load_dcp(oracle("plain"));
  EXPECT_EQ(shoal::testing::compare_state_dicts(dcp.tensors, load_state_dict_file(oracle("plain.pt"))), "");
  EXPECT_EQ(dcp.skipped, std::vector<std::string>{"note.lr"});  // DCP flattens nested dicts
  // What --init-from and shoal ckpt read: the same tensors.
  EXPECT_EQ(shoal::testing::compare_state_dicts(load_state_dict_file(oracle("plain")), dcp.tensors), "");
}

TEST_F(DcpFromPyTorch, Fsdp2ModelSavedOnTwoRanksLoadsWhole) {
  const DcpContents dcp = load_dcp(oracle("fsdp"));
  EXPECT_EQ(shoal::testing::compare_state_dicts(dcp.tensors, load_state_dict_file(oracle("fsdp.pt"))), "");
  EXPECT_TRUE(std::filesystem::exists(oracle("fsdp/__1_0.distcp")));  // really two ranks' files
}

TEST_F(DcpFromPyTorch, HostileMetadataIsRefused) {
  const std::string metadata = "/.metadata";
  expect_error([&] { load_dcp(oracle("outside")); },
               {oracle("outside") + metadata, "'0.weight' lies outside the tensor"});
  expect_error([&] { load_dcp(oracle("overlap")); }, {oracle("overlap") + metadata, "chunks of '0.weight' overlap"});
  expect_error([&] { load_dcp(oracle("dtype")); }, {oracle("dtype/__0_0.distcp"), "float32", "says float64"});
  expect_error([&] { load_dcp(oracle("evil")); }, {oracle("evil") + metadata, "'builtins.eval'", "does not load"});
}

}  // namespace test_checkpoint_format
}  // namespace shoal::checkpoint
