#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/config.h"
#include "common/error.h"
#include "tests/fifo_util.h"
#include "tests/test_util.h"

namespace spade {
namespace {

using ::testing::HasSubstr;
using nlohmann::json;

std::string error_of(const std::string& text) {
  try {
    parse_model_config(text, "cfg.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Config, LoadsRealCheckpoints) {
  auto s = load_model_config(test::data_path("models/stories260K"));
  EXPECT_EQ(s.arch, ModelArch::Llama);
  EXPECT_EQ(s.hidden_size, 64);
  EXPECT_EQ(s.num_layers, 5);
  EXPECT_EQ(s.num_q_heads, 8);
  EXPECT_EQ(s.num_kv_heads, 4);
  EXPECT_EQ(s.head_dim, 8);
  EXPECT_TRUE(s.tie_word_embeddings);
  EXPECT_FALSE(s.qk_norm);
  EXPECT_DOUBLE_EQ(s.rope_theta, 10000.0);
  EXPECT_FLOAT_EQ(s.rms_norm_eps, 1e-5f);
  EXPECT_EQ(s.eos_token_ids, std::vector<int>{2});

  auto q = load_model_config(test::data_path("models/tiny-random-qwen3"));
  EXPECT_EQ(q.arch, ModelArch::Qwen3);
  EXPECT_TRUE(q.qk_norm);
  EXPECT_FALSE(q.tie_word_embeddings);
  EXPECT_DOUBLE_EQ(q.rope_theta, 1e6) << "transformers 5 rope_parameters.rope_theta";
  EXPECT_EQ(q.head_dim, 16);

  auto big = load_model_config(test::data_path("configs/qwen3-8b"));
  EXPECT_DOUBLE_EQ(big.rope_theta, 1e6) << "top-level rope_theta";
  EXPECT_EQ(big.gqa_group(), 4);
  EXPECT_EQ(big.head_dim, 128);

  auto g = load_generation_config(test::data_path("models/stories260K"), s);
  EXPECT_EQ(g.eos_token_ids, std::vector<int>{2});
  EXPECT_FALSE(g.do_sample);
}

TEST(Config, LoadsHybridQwen35) {
  auto t = load_model_config(test::data_path("models/tiny-random-qwen3_5"));
  EXPECT_EQ(t.arch, ModelArch::Qwen3_5);
  EXPECT_EQ(t.model_type, "qwen3_5_text");
  ASSERT_EQ(t.layer_types.size(), 4u);
  EXPECT_EQ(t.layer_types[0], LayerType::LinearAttention);
  EXPECT_EQ(t.layer_types[3], LayerType::FullAttention);
  EXPECT_TRUE(t.is_hybrid());
  EXPECT_EQ(t.num_linear_layers(), 3);
  EXPECT_EQ(t.num_attention_layers(), 1);
  EXPECT_EQ(t.rotary_dim, 8);
  EXPECT_DOUBLE_EQ(t.rope_theta, 1e7);
  EXPECT_EQ(t.linear_conv_kernel_dim, 4);
  EXPECT_EQ(t.linear_num_key_heads, 2);
  EXPECT_EQ(t.linear_num_value_heads, 4);
  EXPECT_EQ(t.linear_conv_dim(), 128);
  EXPECT_TRUE(t.qk_norm && t.attn_output_gate && t.norm_unit_offset);
  EXPECT_EQ(t.weight_prefix, "model.");
  const ModelConfig v = t.attention_view();
  EXPECT_EQ(v.num_layers, 1);
  EXPECT_FALSE(v.is_hybrid());
  EXPECT_EQ(v.kv_dim(), t.kv_dim());

  auto d = load_model_config(test::data_path("configs/qwen3_5_text-transformers-default"));
  EXPECT_EQ(d.num_layers, 32);
  EXPECT_EQ(d.num_attention_layers(), 8) << "3:1 pattern";
  EXPECT_EQ(d.rotary_dim, 64);
  EXPECT_EQ(d.linear_conv_dim(), 2 * 16 * 128 + 32 * 128);

  auto mm = load_model_config(test::data_path("configs/qwen3_5-transformers-default"));
  EXPECT_EQ(mm.model_type, "qwen3_5");
  EXPECT_EQ(mm.arch, ModelArch::Qwen3_5);
  EXPECT_EQ(mm.weight_prefix, "model.language_model.");
  EXPECT_EQ(mm.num_layers, 32);
  EXPECT_EQ(mm.num_linear_layers(), 24);
}

TEST(Config, RejectsMixtureOfExpertsHybrids) {
  EXPECT_THAT(error_of(test::read_file(test::data_path("configs/qwen3_next-transformers-default/config.json"))),
              HasSubstr("model_type 'qwen3_next' is not supported: it is a mixture-of-experts model"));
  EXPECT_THAT(
      error_of(test::read_file(test::data_path("configs/qwen3_5_moe_text-transformers-default/config.json"))),
      HasSubstr("model_type 'qwen3_5_moe_text' is not supported: it is a mixture-of-experts model"));
  EXPECT_THAT(error_of(R"({"model_type": "mamba2"})"), HasSubstr("model_type 'mamba2' is not supported"));
}

TEST(Config, NamesMalformedHybridFields) {
  const std::string base =
      R"("model_type":"qwen3_5_text","hidden_size":64,"intermediate_size":128,"num_hidden_layers":4,)"
      R"("num_attention_heads":4,"num_key_value_heads":2,"head_dim":32,"vocab_size":512)";
  const std::string lin =
      R"(,"linear_conv_kernel_dim":4,"linear_key_head_dim":16,"linear_value_head_dim":16,)"
      R"("linear_num_key_heads":2,"linear_num_value_heads":4)";
  const std::string types = R"(,"layer_types":["linear_attention","linear_attention","linear_attention","full_attention"])";
  EXPECT_EQ(error_of("{" + base + lin + types + "}"), "");
  for (const char* f : {"linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                        "linear_num_key_heads", "linear_num_value_heads"}) {
    json j = json::parse("{" + base + lin + types + "}");
    j.erase(f);
    EXPECT_THAT(error_of(j.dump()), HasSubstr(std::string("cfg.json: required field '") + f + "' is missing"));
  }
  EXPECT_THAT(error_of("{" + base + lin + R"(,"layer_types":["linear_attention","full_attention"]})"),
              HasSubstr("cfg.json: layer_types has 2 entries but num_hidden_layers is 4"));
  EXPECT_THAT(
      error_of("{" + base + lin +
               R"(,"layer_types":["linear_attention","sliding_attention","linear_attention","full_attention"]})"),
      HasSubstr("cfg.json: layer_types[1] 'sliding_attention' is not supported"));
  EXPECT_THAT(error_of("{" + base + lin + R"(,"layer_types":["linear_attention",3,"a","b"]})"),
              HasSubstr("layer_types[1] must be a string"));
  EXPECT_THAT(error_of("{" + base + lin + R"(,"layer_types":"linear_attention"})"),
              HasSubstr("field 'layer_types' must be a list of strings"));
  EXPECT_THAT(error_of("{" + base + types +
                       R"(,"linear_conv_kernel_dim":4,"linear_key_head_dim":16,"linear_value_head_dim":16,)"
                       R"("linear_num_key_heads":3,"linear_num_value_heads":4})"),
              HasSubstr("linear_num_value_heads 4 is not a multiple of linear_num_key_heads 3"));
  EXPECT_THAT(error_of("{" + base + lin + types + R"(,"partial_rotary_factor":0.3})"),
              HasSubstr("rotary dim of 9 for head_dim 32"));
  EXPECT_THAT(error_of("{" + base + lin + types + R"(,"num_experts":8})"),
              HasSubstr("num_experts 8 > 0: mixture-of-experts layers are not supported"));
  EXPECT_THAT(error_of(R"({"model_type":"qwen3_5","vision_config":{}})"),
              HasSubstr("model_type 'qwen3_5' needs a 'text_config' object"));
  // Defaults as transformers: no layer_types -> every full_attention_interval-th layer is full attention; the legacy
  // spellings "mamba" / "attention" map to linear_attention / full_attention.
  auto d = parse_model_config("{" + base + lin + R"(,"full_attention_interval":2})", "x");
  EXPECT_EQ(d.layer_types, (std::vector<LayerType>{LayerType::LinearAttention, LayerType::FullAttention,
                                                   LayerType::LinearAttention, LayerType::FullAttention}));
  auto legacy = parse_model_config("{" + base + lin + R"(,"layer_types":["mamba","mamba","mamba","attention"]})", "x");
  EXPECT_EQ(legacy.num_attention_layers(), 1);
  // Dense families: layer types other than full_attention and partial RoPE are refused rather than ignored.
  const std::string dense =
      R"("model_type":"qwen3","hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,)"
      R"("num_attention_heads":4,"vocab_size":100)";
  EXPECT_EQ(error_of("{" + dense + R"(,"layer_types":["full_attention","full_attention"]})"), "");
  EXPECT_THAT(error_of("{" + dense + R"(,"layer_types":["full_attention","linear_attention"]})"),
              HasSubstr("layer_types[1] 'linear_attention' is not supported for model_type 'qwen3'"));
  EXPECT_THAT(error_of("{" + dense + R"(,"partial_rotary_factor":0.5})"),
              HasSubstr("partial_rotary_factor 0.5 is not supported for model_type 'qwen3'"));
  EXPECT_FALSE(parse_model_config("{" + dense + "}", "x").is_hybrid());
}

TEST(Config, NamesMissingAndBadFields) {
  const std::string base =
      R"("model_type":"llama","hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,)"
      R"("num_attention_heads":4,"vocab_size":100)";
  EXPECT_EQ(error_of("{" + base + "}"), "");
  EXPECT_THAT(error_of("{}"), HasSubstr("cfg.json: required field 'model_type' is missing"));
  EXPECT_THAT(error_of(R"({"model_type":"llama","hidden_size":64})"),
              HasSubstr("cfg.json: required field 'intermediate_size' is missing"));
  EXPECT_THAT(error_of("{" + base + R"(,"num_key_value_heads":3})"),
              HasSubstr("num_attention_heads 4 is not a multiple of num_key_value_heads 3"));
  EXPECT_THAT(error_of(R"({"model_type":"llama","hidden_size":"64"})"),
              HasSubstr("field 'hidden_size' must be an integer"));
  EXPECT_THAT(error_of(R"({"model_type":"llama","hidden_size":-4})"), HasSubstr("must be a positive integer"));
  EXPECT_THAT(error_of("{" + base + R"(,"rope_scaling":{"rope_type":"yarn","factor":4}})"),
              HasSubstr("rope_scaling type 'yarn' is not supported"));
  EXPECT_THAT(error_of("{" + base + R"(,"hidden_act":"gelu"})"), HasSubstr("hidden_act 'gelu' is not supported"));
  EXPECT_THAT(error_of("[1,2]"), HasSubstr("top level is not a JSON object"));
  EXPECT_THAT(error_of("{nope"), HasSubstr("cfg.json: not valid JSON"));
  EXPECT_THAT(error_of("{" + base + R"(,"eos_token_id":"x"})"), HasSubstr("'eos_token_id' must be an integer or a list"));
  try {
    load_model_config("/nonexistent/dir");
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("/nonexistent/dir/config.json: not found"));
  }
}

// Every nonsensical value is refused with the field named (the config as parse_model_config sees it: the same for
// config.json read from a directory).
TEST(Config, RefusesNonsensicalValuesNamingTheField) {
  const json base = json::parse(
      R"({"model_type":"llama","hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,)"
      R"("num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100})");
  ASSERT_EQ(error_of(base.dump()), "");
  const std::vector<std::pair<json, std::string>> cases = {
      {{{"rms_norm_eps", -1e-5}}, "cfg.json: field 'rms_norm_eps' must be a finite number > 0, got -1e-05"},
      {{{"rms_norm_eps", 0}}, "cfg.json: field 'rms_norm_eps' must be a finite number > 0, got 0"},
      {{{"rms_norm_eps", 1e-60}}, "field 'rms_norm_eps' = 1e-60 does not fit a float (it becomes 0)"},
      {{{"rms_norm_eps", 1e60}}, "field 'rms_norm_eps' = 1e+60 does not fit a float (it becomes inf)"},
      {{{"rope_theta", 0}}, "cfg.json: field 'rope_theta' must be a finite number > 0, got 0"},
      {{{"rope_theta", -10000}}, "field 'rope_theta' must be a finite number > 0, got -10000"},
      {{{"rope_parameters", {{"rope_theta", 0}, {"rope_type", "default"}}}},
       "field 'rope_parameters.rope_theta' must be a finite number > 0, got 0"},
      {{{"num_hidden_layers", 2147483647}},
       "cfg.json: field 'num_hidden_layers' = 2147483647 is more than 65536 layers"},
      {{{"num_hidden_layers", 2147483648LL}}, "field 'num_hidden_layers' must be a positive integer, got 2147483648"},
      {{{"num_hidden_layers", 0}}, "field 'num_hidden_layers' must be a positive integer, got 0"},
      {{{"hidden_size", 0}}, "field 'hidden_size' must be a positive integer, got 0"},
      {{{"hidden_size", 64.5}}, "field 'hidden_size' must be an integer, got 64.5"},
      {{{"intermediate_size", -1}}, "field 'intermediate_size' must be a positive integer, got -1"},
      {{{"num_attention_heads", 0}}, "field 'num_attention_heads' must be a positive integer, got 0"},
      {{{"num_key_value_heads", 0}}, "field 'num_key_value_heads' must be a positive integer, got 0"},
      {{{"num_key_value_heads", 3}}, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"},
      {{{"head_dim", 0}}, "field 'head_dim' must be a positive integer, got 0"},
      {{{"head_dim", 15}}, "head_dim 15 must be even for RoPE"},
      {{{"vocab_size", 0}}, "field 'vocab_size' must be a positive integer, got 0"},
      {{{"vocab_size", -7}}, "field 'vocab_size' must be a positive integer, got -7"},
      {{{"max_position_embeddings", 0}}, "field 'max_position_embeddings' must be positive, got 0"},
      {{{"max_position_embeddings", -5}}, "field 'max_position_embeddings' must be positive, got -5"},
      {{{"max_position_embeddings", 4294967301LL}},
       "field 'max_position_embeddings' = 4294967301 does not fit a 32-bit integer"},  // wrapped to 5 before
      {{{"max_position_embeddings", 2147483647}},
       "field 'max_position_embeddings' = 2147483647 is more than 1073741824 positions"},
      {{{"num_attention_heads", 65536}, {"num_key_value_heads", 65536}, {"head_dim", 65536}},
       "num_attention_heads 65536 and num_key_value_heads 65536 times head_dim 65536 give q/k/v projections of more "
       "than 2^31-1 rows"},
      {{{"intermediate_size", 2147483647}}, "field 'intermediate_size' = 2147483647 is too large"},
      {{{"eos_token_id", -1}}, "field 'eos_token_id' holds -1, not a token id"},
      {{{"eos_token_id", {2, 1099511627776LL}}}, "field 'eos_token_id' holds 1099511627776, not a token id"},
      {{{"bos_token_id", -3}}, "field 'bos_token_id' holds -3, not a token id"},
  };
  for (const auto& [patch, want] : cases) {
    json j = base;
    j.update(patch);
    EXPECT_THAT(error_of(j.dump()), HasSubstr(want)) << patch.dump();
  }
  // A number past the double range is refused as JSON, not as an escaping nlohmann exception.
  EXPECT_THAT(error_of(R"({"model_type":"llama","rope_theta":1e999})"), HasSubstr("cfg.json: not valid JSON"));
  // bos_token_id null is "not set".
  json nul = base;
  nul["bos_token_id"] = nullptr;
  EXPECT_EQ(parse_model_config(nul.dump(), "x").bos_token_id, -1);

  // Hybrid widths: the fused GDN input projection must fit an int.
  const json hybrid = json::parse(
      R"({"model_type":"qwen3_5_text","hidden_size":64,"intermediate_size":128,"num_hidden_layers":4,)"
      R"("num_attention_heads":4,"num_key_value_heads":2,"head_dim":32,"vocab_size":512,"linear_conv_kernel_dim":4,)"
      R"("linear_key_head_dim":16,"linear_value_head_dim":16,"linear_num_key_heads":2,"linear_num_value_heads":4})");
  ASSERT_EQ(error_of(hybrid.dump()), "");
  json wide = hybrid;
  wide["linear_num_key_heads"] = 65536;
  wide["linear_num_value_heads"] = 65536;
  wide["linear_key_head_dim"] = 65536;
  EXPECT_THAT(error_of(wide.dump()), HasSubstr("give a linear-attention input projection of more than 2^31-1 rows"));
  json many = hybrid;  // the default layer_types would be generated per layer: refused before
  many["num_hidden_layers"] = 2147483647;
  EXPECT_THAT(error_of(many.dump()), HasSubstr("field 'num_hidden_layers' = 2147483647 is more than 65536 layers"));
}

class ConfigDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::make_temp_dir("spade_cfg_");
    std::filesystem::copy_file(test::data_path("models/stories260K/config.json"), dir_ + "/config.json");
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  void write(const std::string& name, const std::string& text) {
    std::error_code ec;
    std::filesystem::remove(dir_ + "/" + name, ec);
    std::ofstream(dir_ + "/" + name) << text;
  }
  std::string generation_error(const std::string& text) {
    write("generation_config.json", text);
    try {
      load_generation_config(dir_, load_model_config(dir_));
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  }
  std::string dir_;
};

TEST_F(ConfigDirTest, GenerationConfigValuesAreChecked) {
  const std::string g = dir_ + "/generation_config.json";
  EXPECT_EQ(generation_error(R"({"temperature":0.7,"top_p":0.9,"top_k":20,"do_sample":true})"), "");
  EXPECT_EQ(generation_error(R"({"temperature":-1})"),
            g + ": field 'temperature' must be a finite number >= 0, got -1");
  EXPECT_EQ(generation_error(R"({"top_p":1.5})"), g + ": field 'top_p' must be in [0, 1], got 1.5");
  EXPECT_EQ(generation_error(R"({"top_k":-1})"), g + ": field 'top_k' must be >= 0, got -1");
  EXPECT_EQ(generation_error(R"({"top_k":4294967296})"),
            g + ": field 'top_k' = 4294967296 does not fit a 32-bit integer");
  EXPECT_EQ(generation_error(R"({"eos_token_id":[2,-2]})"),
            g + ": field 'eos_token_id' holds -2, not a token id (0 .. 2^31-1)");
  EXPECT_THAT(generation_error(R"({"temperature":1e999})"), HasSubstr(g + ": not valid JSON"));
}

// config.json / generation_config.json as a FIFO (open(2) would block for a writer), a directory, or a link to an
// endless device: refused at once, naming the file and what it is.
TEST_F(ConfigDirTest, NonRegularConfigFilesAreRefusedWithoutBlocking) {
  const std::string c = dir_ + "/config.json", g = dir_ + "/generation_config.json";
  const std::string d = dir_;
  const ModelConfig cfg = load_model_config(dir_);
  test::make_fifo(g);
  EXPECT_EQ(test::error_within([d, cfg] { load_generation_config(d, cfg); }, g),
            g + ": not a regular file (a FIFO); generation_config.json must be a regular file");
  test::make_fifo(c);
  EXPECT_EQ(test::error_within([d] { load_model_config(d); }, c),
            c + ": not a regular file (a FIFO); config.json must be a regular file");
  std::filesystem::remove(c);
  std::filesystem::create_directory(c);
  EXPECT_EQ(test::error_within([d] { load_model_config(d); }, c),
            c + ": not a regular file (a directory); config.json must be a regular file");
  std::filesystem::remove(c);
  std::filesystem::create_symlink("/dev/zero", c);
  EXPECT_EQ(test::error_within([d] { load_model_config(d); }, c),
            c + ": not a regular file (a character device); config.json must be a regular file");
}

// A config.json larger than any real one is refused before it is read (a sparse 65 MiB file).
TEST_F(ConfigDirTest, OversizedConfigIsRefusedBeforeReading) {
  const std::string c = dir_ + "/config.json";
  ASSERT_EQ(::truncate(c.c_str(), (65 << 20)), 0);
  try {
    load_model_config(dir_);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), c + ": config.json is 68157440 bytes, more than the 67108864-byte limit");
  }
}

TEST(Config, ArchitectureDefaults) {
  const std::string base =
      R"("hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,"vocab_size":100)";
  auto q2 = parse_model_config(R"({"model_type":"qwen2",)" + base + "}", "x");
  EXPECT_TRUE(q2.attention_bias);
  EXPECT_FALSE(q2.o_proj_bias);
  EXPECT_EQ(q2.num_kv_heads, 4) << "defaults to num_attention_heads";
  EXPECT_EQ(q2.head_dim, 16) << "defaults to hidden / heads";
  auto l = parse_model_config(R"({"model_type":"llama","attention_bias":true,)" + base + "}", "x");
  EXPECT_TRUE(l.attention_bias);
  EXPECT_TRUE(l.o_proj_bias);
  auto ids = parse_model_config(R"({"model_type":"llama","eos_token_id":[7,9],)" + base + "}", "x");
  EXPECT_EQ(ids.eos_token_ids, (std::vector<int>{7, 9}));
}

}  // namespace
}  // namespace spade
