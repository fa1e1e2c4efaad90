#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/config.h"
#include "common/error.h"
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
