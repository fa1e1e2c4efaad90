// make_demo_checkpoint: writes the embedded default model, a deterministic random-weight Qwen3-architecture
// checkpoint (config.json, model.safetensors in BF16, byte-level tokenizer.json + tokenizer_config.json with ChatML,
// generation_config.json). It is a demo for people without a checkpoint: the text it generates is noise. Real
// checkpoints are passed with --model DIR.
//
//   make_demo_checkpoint --out DIR [--seed S] [--hidden 256 --layers 4 --heads 8 --kv-heads 4 ...]
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "common/config.h"
#include "common/demo_tokenizer.h"
#include "common/error.h"
#include "common/safetensors.h"
#include "inference_rank/weights.h"

namespace {

using nlohmann::json;

void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  if (!f) spade::fail("{}: cannot open for writing", path);
  f << text;
  if (!f) spade::fail("{}: write failed", path);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Writes Spade's embedded demo checkpoint (deterministic random weights, Qwen3 architecture)"};
  std::string out;
  uint64_t seed = 0;
  int hidden = 256, layers = 4, heads = 8, kv_heads = 4, head_dim = 32, inter = 688, max_pos = 4096;
  app.add_option("--out", out, "output directory (created)")->required();
  app.add_option("--seed", seed, "weight seed");
  app.add_option("--hidden", hidden)->check(CLI::PositiveNumber);
  app.add_option("--layers", layers)->check(CLI::PositiveNumber);
  app.add_option("--heads", heads)->check(CLI::PositiveNumber);
  app.add_option("--kv-heads", kv_heads)->check(CLI::PositiveNumber);
  app.add_option("--head-dim", head_dim)->check(CLI::PositiveNumber);
  app.add_option("--intermediate", inter)->check(CLI::PositiveNumber);
  app.add_option("--max-position-embeddings", max_pos)->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  try {
    std::filesystem::create_directories(out);
    const json cfg = {{"architectures", {"Qwen3ForCausalLM"}},
                      {"model_type", "qwen3"},
                      {"hidden_size", hidden},
                      {"intermediate_size", inter},
                      {"num_hidden_layers", layers},
                      {"num_attention_heads", heads},
                      {"num_key_value_heads", kv_heads},
                      {"head_dim", head_dim},
                      {"vocab_size", 259},
                      {"max_position_embeddings", max_pos},
                      {"rms_norm_eps", 1e-6},
                      {"rope_theta", 1000000.0},
                      {"hidden_act", "silu"},
                      {"tie_word_embeddings", false},
                      {"attention_bias", false},
                      {"bos_token_id", 256},
                      {"eos_token_id", 258},
                      {"torch_dtype", "bfloat16"},
                      {"spade_demo", {{"seed", seed}, {"note", "random weights: generated text is noise"}}}};
    const spade::ModelConfig mc = spade::parse_model_config(cfg.dump(), out + "/config.json");
    const auto source = spade::random_source(seed);
    std::vector<spade::TensorToWrite> tensors;
    for (const auto& [name, shape] : spade::expected_tensors(mc)) {
      const auto values = source(name, shape);
      spade::TensorToWrite t{name, spade::DType::BF16, shape, std::vector<uint8_t>(values.size() * 2)};
      auto* dst = reinterpret_cast<uint16_t*>(t.data.data());
      for (size_t i = 0; i < values.size(); ++i) dst[i] = spade::f32_to_bf16(values[i]);
      tensors.push_back(std::move(t));
    }
    spade::write_safetensors(out + "/model.safetensors", tensors, {{"format", "pt"}});
    write_text(out + "/config.json", cfg.dump(2));
    write_text(out + "/generation_config.json",
               json{{"bos_token_id", 256}, {"eos_token_id", {257, 258}}, {"do_sample", false}}.dump(2));
    write_text(out + "/tokenizer.json", spade::demo_byte_level_tokenizer_json());
    const std::string chatml =
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
        "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
    write_text(out + "/tokenizer_config.json",
               json{{"tokenizer_class", "PreTrainedTokenizerFast"},
                    {"bos_token", "<|endoftext|>"},
                    {"eos_token", "<|im_end|>"},
                    {"add_bos_token", false},
                    {"chat_template", chatml}}
                   .dump(2));
    std::fprintf(stderr, "wrote demo checkpoint to %s (%zu tensors, seed %llu)\n", out.c_str(), tensors.size(),
                 static_cast<unsigned long long>(seed));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "make_demo_checkpoint: error: %s\n", e.what());
    return 2;
  }
}
