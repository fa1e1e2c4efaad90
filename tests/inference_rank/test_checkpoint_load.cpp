// Loading malformed Hugging Face checkpoints: each test copies a real tiny checkpoint from the shared data to
// a temp dir, corrupts one thing, and loads it through the loaders the ranks use (Model::load — the CPU model
// and, via its host copy, the GPU upload — load_generation_config, Tokenizer::from_dir,
// ChatTemplate::from_file). Every case must end in a spade::Error naming the file, tensor or config field,
// promptly; never a hang, a bare std::bad_alloc, or a model that loads garbage.
//
// - A FIFO in place of each file kind (model.safetensors, config.json, generation_config.json,
// tokenizer.json,
//   tokenizer_config.json, chat_template.jinja, a --chat-template file, the shard index, a shard): refused at
//   once.
// - NaN / Inf / all-NaN weights (F32 and sharded BF16): refused naming the tensor, its file and the counts.
// - Config values the tensors contradict (hidden_size 1e9, vocab_size, head_dim, num_key_value_heads,
//   intermediate_size, tie_word_embeddings, attention_bias, the linear_* fields of a hybrid, one layer too
//   many) and nonsensical ones (rms_norm_eps < 0, rope_theta 0, num_hidden_layers 2^31-1): refused naming the
//   field; absurd sizes without a checkpoint (Model::random) refused before allocating.
// - Header lies in a real safetensors file (truncation, header length past the end, overlapping or shifted
//   data_offsets, an unknown dtype, a dtype or shape that does not match the bytes, a numel overflow).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "common/chat_template.h"
#include "common/config.h"
#include "common/error.h"
#include "common/safetensors.h"
#include "common/tokenizer.h"
#include "inference_rank/model.h"
#include "tests/fifo_util.h"
#include "tests/test_util.h"

namespace spade {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using ::testing::HasSubstr;
using ::testing::StartsWith;

// The message of the spade::Error `fn` throws; "" when it returns; "unexpected exception: ..." (a test
// failure in every caller) for any other exception, std::bad_alloc included.
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("unexpected exception: ") + e.what();
  }
  return "";
}

class CheckpointLoad : public ::testing::Test {
 protected:
  void TearDown() override {
    std::error_code ec;
    if (!dir_.empty()) fs::remove_all(dir_, ec);
  }

  // Copies the files of shared-data model `rel` to a fresh writable temp dir and returns it.
  const std::string& copy_model(const std::string& rel) {
    const std::string src = test::data_path(rel);
    dir_ = test::make_temp_dir("spade_ckpt_");
    for (const auto& e : fs::directory_iterator(src)) {
      if (!e.is_regular_file()) continue;
      const fs::path to = fs::path(dir_) / e.path().filename();
      fs::copy_file(e.path(), to);
      fs::permissions(to, fs::perms::owner_read | fs::perms::owner_write, fs::perm_options::replace);
    }
    return dir_;
  }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }

  // config.json with `patch` merged in (a null value removes the key).
  void patch_config(const json& patch) {
    json j = json::parse(test::read_file(path("config.json")));
    j.merge_patch(patch);
    std::ofstream(path("config.json"), std::ios::trunc) << j.dump(2);
  }

  // A safetensors file as header JSON + data section, for editing.
  struct Raw {
    json header;
    std::string data;
  };
  static Raw read_raw(const std::string& file) {
    const std::string bytes = test::read_file(file);
    uint64_t n = 0;
    std::memcpy(&n, bytes.data(), 8);
    return {json::parse(bytes.substr(8, n)), bytes.substr(8 + n)};
  }
  static void write_raw(const std::string& file, const Raw& r) {
    const std::string h = r.header.dump();
    const uint64_t n = h.size();
    std::ofstream f(file, std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(&n), 8);
    f << h << r.data;
  }
  // Sets elements [first, first + count) of `tensor` in `file` to the bit pattern `bits` (of the tensor's
  // width).
  static void set_bits(const std::string& file, const std::string& tensor, size_t first, size_t count,
                       uint32_t bits) {
    Raw r = read_raw(file);
    const json& e = r.header.at(tensor);
    const size_t es = e.at("dtype") == "F32" ? 4 : 2;
    const size_t begin = e.at("data_offsets")[0].get<size_t>();
    const size_t end = e.at("data_offsets")[1].get<size_t>();
    ASSERT_LE(begin + (first + count) * es, end) << tensor;
    for (size_t i = first; i < first + count; ++i) std::memcpy(r.data.data() + begin + i * es, &bits, es);
    write_raw(file, r);
  }
  static size_t numel(const std::string& file, const std::string& tensor) {
    const Raw r = read_raw(file);
    size_t n = 1;
    for (const auto& d : r.header.at(tensor).at("shape")) n *= d.get<size_t>();
    return n;
  }

  std::string load_error() const {
    const std::string d = dir_;
    return error_of([&] { Model::load(d); });
  }

  std::string dir_;
};

// ---- the real checkpoints load: the checks refuse nothing real
// ------------------------------------------------------------------------------------------------

TEST_F(CheckpointLoad, RealCheckpointsPassEveryCheck) {
  for (const char* m : {"models/stories260K", "models/tiny-random-qwen3", "models/tiny-random-qwen3_5",
                        "models/longctx-7m"}) {
    SCOPED_TRACE(m);
    const std::string d = test::data_path(m);
    EXPECT_EQ(error_of([&] { Model::load(d); }), "");
    const ModelConfig cfg = load_model_config(d);
    EXPECT_EQ(error_of([&] { check_checkpoint(cfg, Checkpoint::open_dir(d), d + "/config.json"); }), "");
  }
  // The vendored demo model (sharded bf16) too.
  const std::string vendored = std::string(SPADE_SOURCE_DIR) + "/models/longctx-7m";
  EXPECT_EQ(error_of([&] { Model::load(vendored); }), "");
}

// ---- non-regular files
// ------------------------------------------------------------------------------------------------

TEST_F(CheckpointLoad, FifoInPlaceOfEachFileIsRefusedAtOnce) {
  copy_model("models/stories260K");
  const std::string d = dir_;
  auto fifo_error = [&](const std::string& name, std::function<void()> load) {
    SCOPED_TRACE(name);
    const std::string backup = path(name + ".orig");
    fs::rename(path(name), backup);
    test::make_fifo(path(name));
    const std::string msg = test::error_within(std::move(load), path(name));
    fs::remove(path(name));
    fs::rename(backup, path(name));
    return msg;
  };
  auto not_regular = [&](const std::string& name, const std::string& what) {
    return path(name) + ": not a regular file (a FIFO); " + what + " must be a regular file";
  };
  EXPECT_EQ(fifo_error("model.safetensors", [d] { Model::load(d); }),
            not_regular("model.safetensors", "a safetensors file"));
  EXPECT_EQ(fifo_error("config.json", [d] { Model::load(d); }), not_regular("config.json", "config.json"));
  const ModelConfig cfg = load_model_config(d);
  EXPECT_EQ(fifo_error("generation_config.json", [d, cfg] { load_generation_config(d, cfg); }),
            not_regular("generation_config.json", "generation_config.json"));
  EXPECT_EQ(fifo_error("tokenizer.json", [d] { Tokenizer::from_dir(d); }),
            not_regular("tokenizer.json", "tokenizer.json"));
  EXPECT_EQ(fifo_error("tokenizer_config.json", [d] { Tokenizer::from_dir(d); }),
            not_regular("tokenizer_config.json", "tokenizer_config.json"));
  // stories260K's tokenizer_config.json has no chat_template, so chat_template.jinja is read when present.
  test::make_fifo(path("chat_template.jinja"));
  EXPECT_EQ(test::error_within([d] { Tokenizer::from_dir(d); }, path("chat_template.jinja")),
            not_regular("chat_template.jinja", "chat_template.jinja"));
  const std::string tmpl = path("chat_template.jinja");
  EXPECT_EQ(test::error_within([tmpl] { ChatTemplate::from_file(tmpl); }, tmpl),
            not_regular("chat_template.jinja", "a chat template file"));
  fs::remove(tmpl);
  EXPECT_EQ(load_error(), "") << "the restored copy loads";
}

TEST_F(CheckpointLoad, FifoInPlaceOfTheIndexOrAShardIsRefusedAtOnce) {
  copy_model("models/longctx-7m");
  const std::string d = dir_;
  for (const char* name : {"model.safetensors.index.json", "model-00002-of-00002.safetensors"}) {
    SCOPED_TRACE(name);
    const std::string p = path(name);
    fs::rename(p, p + ".orig");
    test::make_fifo(p);
    EXPECT_THAT(test::error_within([d] { Model::load(d); }, p),
                StartsWith(p + ": not a regular file (a FIFO); "));
    fs::remove(p);
    fs::rename(p + ".orig", p);
  }
  EXPECT_EQ(load_error(), "");
}

// ---- non-finite weights
// ------------------------------------------------------------------------------------------------

TEST_F(CheckpointLoad, NonFiniteWeightsAreRefusedNamingTheTensor) {
  copy_model("models/stories260K");
  const std::string f = path("model.safetensors");
  const std::string down = "model.layers.3.mlp.down_proj.weight";
  const size_t n_down = numel(f, down);
  set_bits(f, down, 0, n_down, 0x7fc00000u);  // all NaN
  EXPECT_EQ(load_error(), dir_ + ": tensor '" + down + "' (in " + f + ") holds non-finite values: all " +
                              std::to_string(n_down) + " elements are NaN");
  set_bits(f, down, 0, n_down, 0);  // zeros again
  EXPECT_EQ(load_error(), "");

  set_bits(f, "model.norm.weight", 17, 1, 0xffc00000u);           // one negative NaN
  set_bits(f, "model.embed_tokens.weight", 300, 2, 0x7f800000u);  // two +Inf
  EXPECT_EQ(load_error(),
            dir_ + ": tensor 'model.embed_tokens.weight' (in " + f +
                ") holds non-finite values: 0 NaN and 2 Inf among 32768 elements (first at flat index "
                "300), and 1 more tensor holds NaN or Inf");
  set_bits(f, "model.embed_tokens.weight", 300, 2, 0);
  EXPECT_EQ(load_error(),
            dir_ + ": tensor 'model.norm.weight' (in " + f +
                ") holds non-finite values: 1 NaN and 0 Inf among 64 elements (first at flat index 17)");
}

TEST_F(CheckpointLoad, NonFiniteBf16WeightInASecondShardIsRefused) {
  copy_model("models/longctx-7m");
  const std::string shard = path("model-00002-of-00002.safetensors");
  const json header = read_raw(shard).header;
  std::string tensor;
  for (const auto& [name, e] : header.items())
    if (name != "__metadata__" && name.find("layers.") != std::string::npos) tensor = name;
  ASSERT_FALSE(tensor.empty());
  ASSERT_EQ(header.at(tensor).at("dtype"), "BF16");
  set_bits(shard, tensor, 3, 1, 0xff80u);  // -Inf
  EXPECT_EQ(load_error(), dir_ + ": tensor '" + tensor + "' (in " + shard +
                              ") holds non-finite values: 0 NaN and 1 Inf among " +
                              std::to_string(numel(shard, tensor)) + " elements (first at flat index 3)");
}

// ---- config fields
// ------------------------------------------------------------------------------------------------

TEST_F(CheckpointLoad, ConfigFieldsTheTensorsContradictAreNamed) {
  copy_model("models/stories260K");
  const std::string cfg = path("config.json"), f = path("model.safetensors");
  const json original = json::parse(test::read_file(cfg));
  const std::vector<std::pair<json, std::string>> cases = {
      {{{"rms_norm_eps", -1e-5}}, cfg + ": field 'rms_norm_eps' must be a finite number > 0, got -1e-05"},
      {{{"rope_theta", 0}}, cfg + ": field 'rope_theta' must be a finite number > 0, got 0"},
      {{{"num_hidden_layers", 2147483647}},
       cfg + ": field 'num_hidden_layers' = 2147483647 is more than 65536 layers; no decoder checkpoint has "
             "that many"},
      {{{"num_hidden_layers", 6}},
       cfg + ": num_hidden_layers = 6 but the checkpoint in " + dir_ +
           " holds 5 layers: tensor 'model.layers.5.input_layernorm.weight' is missing"},
      {{{"num_hidden_layers", 65536}},
       cfg + ": num_hidden_layers = 65536 but the checkpoint in " + dir_ +
           " holds 5 layers: tensor 'model.layers.5.input_layernorm.weight' is missing"},
      {{{"hidden_size", 1000000000}},
       cfg + ": hidden_size = 1000000000 but tensor 'model.embed_tokens.weight' (in " + f +
           ") is [512, 64] (dimension 1 should be 1000000000)"},
      {{{"vocab_size", 32000}},
       cfg + ": vocab_size = 32000 but tensor 'model.embed_tokens.weight' (in " + f +
           ") is [512, 64] (dimension 0 should be 32000)"},
      {{{"head_dim", 16}},
       cfg +
           ": num_attention_heads 8 x head_dim 16 = 128 but tensor 'model.layers.0.self_attn.q_proj.weight' "
           "(in " +
           f + ") is [64, 64] (dimension 0 should be 128)"},
      {{{"num_key_value_heads", 8}},
       cfg +
           ": num_key_value_heads 8 x head_dim 8 = 64 but tensor 'model.layers.0.self_attn.k_proj.weight' "
           "(in " +
           f + ") is [32, 64] (dimension 0 should be 64)"},
      {{{"intermediate_size", 999}},
       cfg + ": intermediate_size = 999 but tensor 'model.layers.0.mlp.gate_proj.weight' (in " + f +
           ") is [172, 64] (dimension 0 should be 999)"},
      {{{"tie_word_embeddings", false}},
       dir_ + ": tensor 'lm_head.weight' not found; " + cfg + " needs it (tie_word_embeddings is false)"},
      {{{"attention_bias", true}},
       dir_ + ": tensor 'model.layers.0.self_attn.q_proj.bias' not found; " + cfg +
           " needs it (attention_bias / mlp_bias of model_type llama)"},
  };
  for (const auto& [patch, want] : cases) {
    SCOPED_TRACE(patch.dump());
    std::ofstream(cfg, std::ios::trunc) << original.dump();
    patch_config(patch);
    EXPECT_EQ(load_error(), want);
  }
  // Fewer layers than the checkpoint holds: the first ones are used (as transformers, which warns).
  std::ofstream(cfg, std::ios::trunc) << original.dump();
  patch_config({{"num_hidden_layers", 4}});
  std::unique_ptr<Model> m;
  ASSERT_EQ(error_of([&] { m = Model::load(dir_); }), "");
  EXPECT_EQ(m->config().num_layers, 4);
}

TEST_F(CheckpointLoad, HybridLinearAttentionFieldsTheTensorsContradictAreNamed) {
  copy_model("models/tiny-random-qwen3_5");
  const std::string cfg = path("config.json"), f = path("model.safetensors");
  const json original = json::parse(test::read_file(cfg));
  EXPECT_EQ(load_error(), "");
  const std::vector<std::pair<json, std::string>> cases = {
      {{{"linear_conv_kernel_dim", 3}},
       cfg + ": linear_conv_kernel_dim = 3 but tensor 'model.layers.0.linear_attn.conv1d.weight' (in " + f +
           ") is [128, 1, 4] (dimension 2 should be 3)"},
      {{{"linear_num_value_heads", 2}},
       cfg +
           ": 2 x linear_num_key_heads 2 x linear_key_head_dim 16 + linear_num_value_heads 2 x "
           "linear_value_head_dim "
           "16 = 96 but tensor 'model.layers.0.linear_attn.in_proj_qkv.weight' (in " +
           f + ") is [128, 64] (dimension 0 should be 96)"},
  };
  for (const auto& [patch, want] : cases) {
    SCOPED_TRACE(patch.dump());
    std::ofstream(cfg, std::ios::trunc) << original.dump();
    patch_config(patch);
    EXPECT_EQ(load_error(), want);
  }
}

// Without a checkpoint (--random-weights) the only bound on the sizes is the host: refused before allocating,
// naming the fields, never a bare std::bad_alloc.
TEST(RandomWeights, AbsurdSizesAreRefusedBeforeAllocating) {
  json j = json::parse(test::read_file(test::data_path("models/stories260K/config.json")));
  j["hidden_size"] = 1000000000;
  const ModelConfig cfg = parse_model_config(j.dump(), "cfg.json");
  const auto t0 = std::chrono::steady_clock::now();
  const std::string msg = error_of([&] { Model::random(cfg, 1); });
  EXPECT_THAT(msg, StartsWith("model config 'llama': hidden_size 1000000000, intermediate_size 172, "
                              "num_hidden_layers 5 and vocab_size 512 give "));
  EXPECT_THAT(msg, HasSubstr("GiB as fp32, more than this host's"));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
}

// ---- safetensors header lies, in a real file
// ------------------------------------------------------------------------------------------------

TEST_F(CheckpointLoad, HeaderLiesInARealFileNameTheFileAndTensor) {
  copy_model("models/stories260K");
  const std::string f = path("model.safetensors");
  const Raw good = read_raw(f);
  const std::string emb = "model.embed_tokens.weight";
  auto with = [&](const std::function<void(Raw&)>& edit) {
    Raw r = good;
    edit(r);
    write_raw(f, r);
    return load_error();
  };
  EXPECT_EQ(with([](Raw&) {}), "");
  // Truncated by one byte: the last tensor's end is past the data section.
  EXPECT_THAT(with([](Raw& r) { r.data.pop_back(); }),
              AllOf(StartsWith(f + ": tensor '"), HasSubstr("end past the data section")));
  // Overlapping: the embedding moved onto the next tensor's bytes.
  EXPECT_THAT(with([&](Raw& r) {
                r.header[emb]["data_offsets"] = {256, 131328};
              }),
              AllOf(StartsWith(f + ": tensors '"), HasSubstr("overlap")));
  EXPECT_EQ(with([&](Raw& r) { r.header[emb]["dtype"] = "F64"; }),
            f + ": tensor '" + emb + "': unsupported dtype 'F64' (accepted: F32, F16, BF16)");
  EXPECT_EQ(with([&](Raw& r) { r.header[emb]["dtype"] = "BF16"; }),
            f + ": tensor '" + emb +
                "': data_offsets [0, 131072] hold 131072 bytes but shape [512, 64] of BF16 needs "
                "65536");
  EXPECT_EQ(with([&](Raw& r) {
              r.header[emb]["shape"] = {512, 65};
            }),
            f + ": tensor '" + emb +
                "': data_offsets [0, 131072] hold 131072 bytes but shape [512, 65] of F32 needs "
                "133120");
  EXPECT_THAT(with([&](Raw& r) {
                r.header[emb]["shape"] = {int64_t{1} << 62, 8};
              }),
              AllOf(StartsWith(f + ": tensor '" + emb + "': "), HasSubstr("overflow")));
  EXPECT_EQ(with([&](Raw& r) {
              r.header[emb]["data_offsets"] = {0, -1};
            }),
            f + ": tensor '" + emb + "': data_offsets[1] is number -1, expected a non-negative integer");
  // The header length prefix claims more bytes than the file holds.
  write_raw(f, good);
  {
    std::fstream io(f, std::ios::in | std::ios::out | std::ios::binary);
    const uint64_t lie = fs::file_size(f);
    io.write(reinterpret_cast<const char*>(&lie), 8);
  }
  EXPECT_THAT(load_error(),
              AllOf(StartsWith(f + ": header length "), HasSubstr("runs past the end of the file")));
}

}  // namespace
}  // namespace spade

TEST(LoadProgress, SaysBytesRateAndTimeLeft) {
  spade::LoadProgress p("ckpt", size_t{1} << 30, /*terminal=*/false);
  p.add(size_t{1} << 29);
  const std::string line = p.status(spade::LoadProgress::Clock::now() + std::chrono::seconds(1));
  EXPECT_NE(line.find("ckpt: loading 0.50 / 1.00 GiB (50%)"), std::string::npos) << line;
  EXPECT_NE(line.find("MiB/s, ETA"), std::string::npos) << line;
  p.add(size_t{1} << 29);
  EXPECT_NE(p.status(spade::LoadProgress::Clock::now()).find("(100%)"), std::string::npos);
  p.finish();
}
