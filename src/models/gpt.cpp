#include "shoal/models/gpt.h"

#include <torch/nn/functional/dropout.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/init.h>
#include <torch/utils.h>

#include <cmath>

#include "shoal/error.h"
#include "shoal/parallel/tensor_parallel.h"

namespace shoal::models {
namespace {

namespace F = torch::nn::functional;

/// nanoGPT's initialisation: N(0, 0.02) weights.
constexpr double kInitStd = 0.02;

torch::nn::LayerNorm gpt_layer_norm(int64_t dim) {
  return torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim}));
}

/// Dropout of `x` with probability p, its mask drawn from `generator` (undefined: torch's default
/// generator, through F::dropout as before generators could be given).
at::Tensor gpt_dropout(const at::Tensor& x, double p, bool training,
                       const at::Generator& generator = {}) {
  if (p == 0 || !training) return x;
  if (!generator.defined()) return F::dropout(x, F::DropoutFuncOptions().p(p).training(true));
  // The generators are CPU ones (the mask is drawn on the CPU for another device's tensor).
  const at::Tensor keep =
      at::empty(x.sizes(), x.options().device(at::kCPU)).bernoulli_(1 - p, generator);
  return x * keep.to(x.device()) * (1 / (1 - p));
}

/// Token ids [B, T] the GPT can take: integers, T at most the block size.
void check_token_ids(const at::Tensor& idx, const GptConfig& config) {
  SHOAL_CHECK_T(InvalidArgument, idx.dim() == 2 && !at::isFloatingType(idx.scalar_type()),
                "the gpt model takes token ids [B, T] (integers), got ", idx.scalar_type(), " ",
                idx.sizes());
  SHOAL_CHECK_T(InvalidArgument, idx.size(1) <= config.block_size, "the gpt model's block size is ",
                config.block_size, " tokens, got sequences of ", idx.size(1),
                "; raise --block-size or cut the sequences");
}

/// The positions 0..T-1 of token ids [B, T].
at::Tensor positions_of(const at::Tensor& idx) {
  return at::arange(idx.size(1), idx.options().dtype(at::kLong));
}

/// nanoGPT's loss: the mean cross-entropy of logits [..., V] against targets [...], over the
/// targets that are not -1.
at::Tensor token_cross_entropy(const at::Tensor& logits, const at::Tensor& targets) {
  return F::cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}).to(at::kLong),
                          F::CrossEntropyFuncOptions().ignore_index(-1));
}

constexpr size_t kQkv = 0, kAttnProj = 1;  // CausalSelfAttention's hookable layers
constexpr size_t kFc = 0, kMlpProj = 1;    // GptMlp's
constexpr size_t kWte = 0, kLmHead = 1, kWpe = 2, kLnF = 3;  // Gpt's
constexpr size_t kLn1 = 0, kLn2 = 1;                        // GptBlock's

}  // namespace

void GptConfig::validate() const {
  SHOAL_CHECK_T(InvalidArgument, n_layer >= 1 && n_layer <= 1024,
                "--n-layer must be in [1, 1024], got ", n_layer);
  SHOAL_CHECK_T(InvalidArgument, n_head >= 1, "--n-head must be at least 1, got ", n_head);
  SHOAL_CHECK_T(InvalidArgument, n_embd >= 1 && n_embd % n_head == 0,
                "--n-embd must be a positive multiple of --n-head (each head takes n_embd / n_head "
                "channels), got n_embd ", n_embd, " and n_head ", n_head);
  SHOAL_CHECK_T(InvalidArgument, block_size >= 1 && block_size <= (int64_t{1} << 20),
                "--block-size must be in [1, 1048576] tokens, got ", block_size);
  SHOAL_CHECK_T(InvalidArgument, vocab_size >= 1 && vocab_size <= (int64_t{1} << 24),
                "--vocab-size must be in [1, 16777216], got ", vocab_size);
  SHOAL_CHECK_T(InvalidArgument, dropout >= 0 && dropout < 1, "--dropout must be in [0, 1), got ",
                dropout);
}

CausalSelfAttention::CausalSelfAttention(const GptConfig& config)
    : LayerForwardHooks({"c_attn", "c_proj"}),
      head_size_(config.n_embd / config.n_head),
      dropout_(config.dropout) {
  c_attn = register_module("c_attn", torch::nn::Linear(config.n_embd, 3 * config.n_embd));
  c_proj = register_module("c_proj", torch::nn::Linear(config.n_embd, config.n_embd));
}

at::Tensor CausalSelfAttention::forward(const at::Tensor& x) {
  const at::Tensor qkv_all =
      call_layer(kQkv, *c_attn, x, [&](const at::Tensor& in) { return c_attn->forward(in); });
  // The whole sequence, also when x is a sequence shard (c_attn's hook gathers it).
  const int64_t batch = qkv_all.size(0), tokens = qkv_all.size(1);
  // [B,T,3C'] -> q, k, v as [B,nh',T,hs], C' = nh' * hs (nh' < n_head when c_attn is sharded)
  const int64_t channels = qkv_all.size(2) / 3;
  const std::vector<at::Tensor> qkv = qkv_all.split(channels, 2);
  const auto heads = [&](const at::Tensor& t) {
    return t.view({batch, tokens, channels / head_size_, head_size_}).transpose(1, 2);
  };
  const at::Tensor q = heads(qkv[0]), k = heads(qkv[1]), v = heads(qkv[2]);
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_size_));
  at::Tensor att = at::matmul(q, k.transpose(-2, -1)) * scale;
  const at::Tensor future = at::ones({tokens, tokens}, x.options().dtype(at::kBool)).triu(1);
  att = at::softmax(att.masked_fill(future, -INFINITY), -1);
  att = gpt_dropout(att, dropout_, is_training(), generators_.sharded);
  const at::Tensor y =
      at::matmul(att, v).transpose(1, 2).contiguous().view({batch, tokens, channels});
  const at::Tensor out =
      call_layer(kAttnProj, *c_proj, y, [&](const at::Tensor& in) { return c_proj->forward(in); });
  return gpt_dropout(out, dropout_, is_training(), generators_.replicated);
}

GptMlp::GptMlp(const GptConfig& config)
    : LayerForwardHooks({"c_fc", "c_proj"}), dropout_(config.dropout) {
  c_fc = register_module("c_fc", torch::nn::Linear(config.n_embd, 4 * config.n_embd));
  c_proj = register_module("c_proj", torch::nn::Linear(4 * config.n_embd, config.n_embd));
}

at::Tensor GptMlp::forward(const at::Tensor& x) {
  const at::Tensor hidden =
      call_layer(kFc, *c_fc, x, [&](const at::Tensor& in) { return c_fc->forward(in); });
  const at::Tensor out = call_layer(kMlpProj, *c_proj, at::gelu(hidden),
                                    [&](const at::Tensor& in) { return c_proj->forward(in); });
  return gpt_dropout(out, dropout_, is_training(), generators_.replicated);
}

GptBlock::GptBlock(const GptConfig& config) : LayerForwardHooks({"ln_1", "ln_2"}) {
  ln_1 = register_module("ln_1", gpt_layer_norm(config.n_embd));
  attn = register_module("attn", std::make_shared<CausalSelfAttention>(config));
  ln_2 = register_module("ln_2", gpt_layer_norm(config.n_embd));
  mlp = register_module("mlp", std::make_shared<GptMlp>(config));
}

at::Tensor GptBlock::forward(const at::Tensor& x) {
  const auto norm = [this](size_t index, torch::nn::LayerNorm& ln, const at::Tensor& in) {
    return call_layer(index, *ln, in, [&](const at::Tensor& t) { return ln->forward(t); });
  };
  const at::Tensor y = x + attn->forward(norm(kLn1, ln_1, x));
  return y + mlp->forward(norm(kLn2, ln_2, y));
}

Gpt::Gpt(const GptConfig& config)
    : LayerForwardHooks({"transformer.wte", "lm_head", "transformer.wpe", "transformer.ln_f"}),
      config_(config) {
  config_.validate();
  transformer = register_module("transformer", std::make_shared<torch::nn::Module>());
  wte = transformer->register_module("wte", torch::nn::Embedding(config.vocab_size, config.n_embd));
  wpe = transformer->register_module("wpe", torch::nn::Embedding(config.block_size, config.n_embd));
  h = transformer->register_module("h", torch::nn::ModuleList());
  for (int64_t i = 0; i < config.n_layer; ++i) h->push_back(std::make_shared<GptBlock>(config));
  ln_f = transformer->register_module("ln_f", gpt_layer_norm(config.n_embd));
  // Weight tying: the output head is the token embedding (one tensor under both names).
  lm_head = register_module("lm_head", std::make_shared<torch::nn::Module>());
  lm_head->register_parameter("weight", wte->weight);
  init_weights();
}

void Gpt::init_weights() {
  torch::NoGradGuard no_grad;
  const double proj_std = kInitStd / std::sqrt(2.0 * static_cast<double>(config_.n_layer));
  for (const auto& item : named_parameters()) {
    const std::string& name = item.key();
    at::Tensor p = item.value();
    if (name.find("ln_") != std::string::npos || name == "lm_head.weight") continue;
    if (name.size() >= 5 && name.compare(name.size() - 5, 5, ".bias") == 0) {
      p.zero_();
    } else {
      const bool residual = name.find("c_proj.weight") != std::string::npos;
      torch::nn::init::normal_(p, 0.0, residual ? proj_std : kInitStd);
    }
  }
}

void Gpt::set_sharded_logits(ShardedLogits logits) {
  SHOAL_CHECK_T(InvalidArgument, logits.gather && logits.cross_entropy,
                "Gpt::set_sharded_logits needs both gather and cross_entropy");
  sharded_logits_ = std::move(logits);
}

void Gpt::set_dropout_generators(const DropoutGenerators& generators) {
  generators_ = generators;
  for (const auto& block : *h) {
    block->as<GptBlock>()->attn->set_dropout_generators(generators);
    block->as<GptBlock>()->mlp->set_dropout_generators(generators);
  }
}

at::Tensor Gpt::head_output(const at::Tensor& idx) {
  check_token_ids(idx, config_);
  const at::Tensor tokens_in = call_layer(kWte, *wte, idx.to(at::kLong),
                                          [&](const at::Tensor& in) { return wte->forward(in); });
  const at::Tensor positions = call_layer(kWpe, *wpe, positions_of(idx),
                                          [&](const at::Tensor& in) { return wpe->forward(in); });
  at::Tensor x =
      gpt_dropout(tokens_in + positions, config_.dropout, is_training(), generators_.replicated);
  for (const auto& block : *h) x = block->as<GptBlock>()->forward(x);
  const at::Tensor normed =
      call_layer(kLnF, *ln_f, x, [&](const at::Tensor& in) { return ln_f->forward(in); });
  return call_layer(kLmHead, *lm_head, normed,
                    [&](const at::Tensor& in) { return at::linear(in, wte->weight); });
}

at::Tensor Gpt::forward(at::Tensor idx) {
  const at::Tensor logits = head_output(idx);
  return sharded_logits_.gather ? sharded_logits_.gather(logits) : logits;
}

at::Tensor Gpt::forward_loss(const at::Tensor& idx, const at::Tensor& targets) {
  const at::Tensor logits = head_output(idx);
  if (sharded_logits_.cross_entropy) {
    return sharded_logits_.cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                         targets.reshape({-1}).to(at::kLong));
  }
  return token_cross_entropy(logits, targets);
}

torch::nn::Sequential Gpt::as_sequential() {
  torch::nn::Sequential chain;
  chain->push_back("embeddings", std::make_shared<GptEmbeddings>(wte, wpe, config_));
  for (size_t i = 0; i < h->size(); ++i) {
    chain->push_back("h_" + std::to_string(i), std::dynamic_pointer_cast<GptBlock>(h->ptr(i)));
  }
  chain->push_back("head", std::make_shared<GptHead>(ln_f, lm_head));
  return chain;
}

SequentialLoss Gpt::sequential_loss() {
  SequentialLoss own;
  own.loss = token_cross_entropy;
  own.terms = [](const at::Tensor& targets) { return targets.ne(-1).sum().item<int64_t>(); };
  return own;
}

GptEmbeddings::GptEmbeddings(torch::nn::Embedding wte_in, torch::nn::Embedding wpe_in,
                             const GptConfig& config)
    : config_(config) {
  wte = register_module("wte", std::move(wte_in));
  wpe = register_module("wpe", std::move(wpe_in));
}

at::Tensor GptEmbeddings::forward(const at::Tensor& idx) {
  check_token_ids(idx, config_);
  return gpt_dropout(wte->forward(idx.to(at::kLong)) + wpe->forward(positions_of(idx)),
                     config_.dropout, wte->is_training());
}

GptHead::GptHead(torch::nn::LayerNorm ln_f_in, std::shared_ptr<torch::nn::Module> lm_head_in) {
  ln_f = register_module("ln_f", std::move(ln_f_in));
  lm_head = register_module("lm_head", std::move(lm_head_in));
}

at::Tensor GptHead::forward(const at::Tensor& x) {
  return at::linear(ln_f->forward(x), lm_head->named_parameters(false)["weight"]);
}

std::shared_ptr<Model> Gpt::copy() const {
  auto copy = std::make_shared<Gpt>(config_);
  torch::NoGradGuard no_grad;
  const auto parameters = named_parameters();
  for (auto& item : copy->named_parameters()) item.value().copy_(parameters[item.key()]);
  const auto buffers = named_buffers();
  for (auto& item : copy->named_buffers()) item.value().copy_(buffers[item.key()]);
  return copy;
}

parallel::TensorParallelLayout Gpt::parallelize(std::shared_ptr<comm::ProcessGroup> tp) {
  return parallel::parallelize_gpt(*this, std::move(tp));
}

at::Tensor Gpt::generate(const at::Tensor& idx, const GenerateOptions& options,
                         at::Generator generator) {
  SHOAL_CHECK_T(InvalidArgument, options.temperature > 0 && std::isfinite(options.temperature),
                "--temperature must be a positive number, got ", options.temperature);
  SHOAL_CHECK_T(InvalidArgument, options.top_k >= 0 && options.max_new_tokens >= 0,
                "--top-k and --max-new-tokens must be >= 0, got ", options.top_k, " and ",
                options.max_new_tokens);
  torch::NoGradGuard no_grad;
  at::Tensor tokens = idx.to(at::kLong);
  for (int64_t n = 0; n < options.max_new_tokens; ++n) {
    const int64_t length = tokens.size(1);
    const at::Tensor context =
        length <= config_.block_size ? tokens : tokens.slice(1, length - config_.block_size);
    at::Tensor logits = forward(context).select(1, context.size(1) - 1) / options.temperature;
    if (options.top_k > 0) {
      const int64_t k = std::min(options.top_k, logits.size(-1));
      const at::Tensor kth = std::get<0>(logits.topk(k)).slice(1, k - 1);
      logits = logits.masked_fill(logits < kth, -INFINITY);
    }
    const at::Tensor next = at::multinomial(at::softmax(logits, -1), 1, false, generator);
    tokens = at::cat({tokens, next}, 1);
  }
  return tokens;
}

}  // namespace shoal::models
