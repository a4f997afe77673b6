// libFuzzer target: the checkpoint unpickler (data.pkl of torch.save files) on arbitrary bytes.
// Every input must end in a value or a CheckpointError: no crash, no unbounded recursion, read
// as torch.save's data.pkl and as DCP's .metadata.
#include <cstdint>
#include <string>

#include <ATen/Functions.h>

#include "checkpoint/unpickler.h"
#include "shoal/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto load_storage = [](const std::string&, c10::ScalarType dtype, int64_t numel) {
    if (numel > 4096) SHOAL_THROW(shoal::CheckpointError, "storage too large for the fuzzer");
    return at::zeros({numel}, at::TensorOptions().dtype(dtype));
  };
  // Each input twice: as a torch.save pickle, and as a DCP checkpoint's .metadata.
  for (const bool dcp : {false, true}) {
    shoal::checkpoint::detail::UnpicklerLimits limits;
    limits.dcp_metadata = dcp;
    try {
      shoal::checkpoint::detail::Unpickler(std::string_view(reinterpret_cast<const char*>(data), size),
                                           load_storage, "fuzz", limits)
          .load();
    } catch (const shoal::CheckpointError&) {
    }
  }
  return 0;
}
