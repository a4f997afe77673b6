// A GPT-2-style causal language model (nanoGPT's model.py): token and position embeddings,
// pre-LayerNorm blocks of causal self-attention and a 4x GELU MLP, a final LayerNorm, and an
// output head tied to the token embedding. Its parameters carry nanoGPT's names
// (transformer.wte.weight, transformer.h.0.attn.c_attn.weight, ..., lm_head.weight, which is
// transformer.wte.weight), so a state dict moves between it and nanoGPT's GPT with
// load_state_dict. nanoGPT's causal-mask buffer (attn.bias) is not a buffer here: the mask is
// made per forward.
//
// It computes its own loss (owns_loss): forward_loss(idx, targets) is the cross-entropy of the
// next-token logits over the vocabulary (targets -1 are ignored), nanoGPT's
// GPT.forward(idx, targets). Initialised as nanoGPT does: every Linear and Embedding weight
// N(0, 0.02), the residual projections (c_proj) N(0, 0.02 / sqrt(2 n_layer)), biases 0.
//
// Pipeline parallelism cuts it between blocks (as_sequential: embeddings, blocks, final LayerNorm
// with the head); the tied weight then lives on the first and the last stage, whose gradients
// the pipeline sums (pipeline/tied_parameters.h).
//
// Tensor parallelism (parallel/tensor_parallel.h) splits the GPT's layers across ranks: the
// modules here call their Linear and Embedding layers through LayerForwardHooks, where it puts its
// collectives; the attention's forward takes as many heads as its (possibly sharded) c_attn yields.
//
// Thread safety: that of torch::nn::Module (see model.h); set hooks before training.
#pragma once

#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <ATen/core/Generator.h>

#include <functional>
#include <string>
#include <vector>

#include "shoal/models/gpt_config.h"
#include "shoal/models/layer_forward_hooks.h"
#include "shoal/models/model.h"

namespace shoal::models {

/// Multi-head causal self-attention: c_attn (q, k, v in one Linear), c_proj.
/// Hookable layers: c_attn, c_proj. The heads are as many as c_attn's output holds (all of them,
/// or a tensor-parallel rank's share when c_attn is sharded by heads).
class CausalSelfAttention : public torch::nn::Module, public LayerForwardHooks {
 public:
  explicit CausalSelfAttention(const GptConfig& config);
  /// [B,T,C] -> [B,T,C]; position t attends to positions <= t.
  at::Tensor forward(const at::Tensor& x);

  torch::nn::Linear c_attn{nullptr};
  torch::nn::Linear c_proj{nullptr};
  /// Draws the attention dropout from generators.sharded, the residual's from .replicated.
  void set_dropout_generators(const DropoutGenerators& generators) { generators_ = generators; }

 private:
  int64_t head_size_;
  double dropout_;
  DropoutGenerators generators_;
};

/// The block's MLP: c_fc (C -> 4C), GELU, c_proj (4C -> C).
/// Hookable layers: c_fc, c_proj.
class GptMlp : public torch::nn::Module, public LayerForwardHooks {
 public:
  explicit GptMlp(const GptConfig& config);
  at::Tensor forward(const at::Tensor& x);

  torch::nn::Linear c_fc{nullptr};
  torch::nn::Linear c_proj{nullptr};
  /// Draws the residual dropout from generators.replicated.
  void set_dropout_generators(const DropoutGenerators& generators) { generators_ = generators; }

 private:
  double dropout_;
  DropoutGenerators generators_;
};

/// x + attn(ln_1(x)), then + mlp(ln_2(x)). Hookable layers: ln_1, ln_2 (sequence parallelism
/// runs them on sequence shards).
class GptBlock : public torch::nn::Module, public LayerForwardHooks {
 public:
  explicit GptBlock(const GptConfig& config);
  at::Tensor forward(const at::Tensor& x);

  torch::nn::LayerNorm ln_1{nullptr};
  std::shared_ptr<CausalSelfAttention> attn;
  torch::nn::LayerNorm ln_2{nullptr};
  std::shared_ptr<GptMlp> mlp;
};

/// The first layer of the GPT's sequential form (Gpt::as_sequential): token ids [B,T] -> token
/// plus position embeddings [B,T,C], then dropout, over the GPT's own wte and wpe. Its dropout
/// follows the GPT's train()/eval() (through wte's mode), as the GPT's forward does.
class GptEmbeddings : public torch::nn::Module {
 public:
  GptEmbeddings(torch::nn::Embedding wte, torch::nn::Embedding wpe, const GptConfig& config);
  at::Tensor forward(const at::Tensor& idx);

  torch::nn::Embedding wte{nullptr};
  torch::nn::Embedding wpe{nullptr};

 private:
  GptConfig config_;
};

/// The last layer of the GPT's sequential form: ln_f, then the output head tied to the token
/// embedding, [B,T,C] -> logits [B,T,vocab_size], over the GPT's own ln_f and lm_head.
class GptHead : public torch::nn::Module {
 public:
  GptHead(torch::nn::LayerNorm ln_f, std::shared_ptr<torch::nn::Module> lm_head);
  at::Tensor forward(const at::Tensor& x);

  torch::nn::LayerNorm ln_f{nullptr};
  std::shared_ptr<torch::nn::Module> lm_head;
};

/// How Gpt::generate samples (nanoGPT's sample.py).
struct GenerateOptions {
  /// Tokens appended to the prompt.
  int64_t max_new_tokens = 100;
  /// The logits are divided by it before sampling; > 0 (lower: more likely tokens).
  double temperature = 1.0;
  /// > 0: only the top_k most likely tokens are drawn from (1: greedy); 0: all of them.
  int64_t top_k = 0;
};

/// What Gpt does with its head's output when a hook on "lm_head" makes it logits sharded over the
/// vocabulary (tensor parallelism's vocabulary-parallel head), so the loss never needs them whole.
struct ShardedLogits {
  /// This rank's logits [..., V/tp] -> the full logits [..., V] (forward()).
  std::function<at::Tensor(const at::Tensor& local)> gather;
  /// This rank's logits [N, V/tp] and targets [N] (-1: ignored) -> the mean cross-entropy.
  std::function<at::Tensor(const at::Tensor& local, const at::Tensor& targets)> cross_entropy;
};

/// The decoder; forward(idx [B,T] int64) -> logits [B,T,vocab_size]. Hookable layers:
/// transformer.wte (token ids in, embeddings out), lm_head (ln_f's output in, logits out),
/// transformer.wpe (the positions 0..T-1 in, their embeddings out) and transformer.ln_f.
class Gpt : public Model, public LayerForwardHooks {
 public:
  explicit Gpt(const GptConfig& config = {});
  /// Next-token logits at every position, [B,T,vocab_size]; T <= block_size.
  at::Tensor forward(at::Tensor idx) override;
  bool owns_loss() const override { return true; }
  /// Mean cross-entropy of forward(idx) against targets [B,T] (ids, or -1 to ignore a position).
  at::Tensor forward_loss(const at::Tensor& idx, const at::Tensor& targets) override;
  /// A GPT of this config with a copy of these weights.
  std::shared_ptr<Model> copy() const override;
  /// parallel::parallelize_gpt: attention heads, MLP width and vocabulary split over `tp`.
  parallel::TensorParallelLayout parallelize(std::shared_ptr<comm::ProcessGroup> tp) override;
  const GptConfig& config() const { return config_; }
  /// GptEmbeddings, the blocks (h_0, h_1, ...), GptHead: the GPT's own layers, so a pipeline can
  /// cut it between blocks. The first and the last layer share the tied wte.weight; a pipeline
  /// whose first and last stage differ keeps one copy on each (pipeline::TiedParameters).
  torch::nn::Sequential as_sequential() override;
  /// The mean cross-entropy of the chain's logits (forward_loss's), over the targets not ignored.
  SequentialLoss sequential_loss() override;
  /// idx [B,T] followed by options.max_new_tokens tokens, each drawn with `generator` from the
  /// next-token distribution of the last block_size tokens (nanoGPT's GPT.generate). Runs without
  /// autograd, in the model's current mode (call eval() first to turn dropout off).
  at::Tensor generate(const at::Tensor& idx, const GenerateOptions& options,
                      at::Generator generator);

  /// nanoGPT's `transformer` ModuleDict: wte, wpe, h (the blocks), ln_f.
  std::shared_ptr<torch::nn::Module> transformer;
  torch::nn::Embedding wte{nullptr};
  torch::nn::Embedding wpe{nullptr};
  torch::nn::ModuleList h;
  torch::nn::LayerNorm ln_f{nullptr};
  /// Holds `weight`, the tied wte.weight, under nanoGPT's name.
  std::shared_ptr<torch::nn::Module> lm_head;

  /// From now on the head's output is treated as `logits` says (both functions set).
  void set_sharded_logits(ShardedLogits logits);
  /// From now on every dropout of the GPT (embedding, attention, residual) draws from
  /// `generators` (see DropoutGenerators); the sequential form's (as_sequential) keeps the default.
  void set_dropout_generators(const DropoutGenerators& generators) override;

 private:
  void init_weights();
  /// The head's output for idx: the logits, or this rank's shard of them (ShardedLogits).
  at::Tensor head_output(const at::Tensor& idx);
  GptConfig config_;
  ShardedLogits sharded_logits_;
  DropoutGenerators generators_;
};

}  // namespace shoal::models
