#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/config.h"
#include "common/error.h"
#include "tests/test_util.h"

namespace spade {
namespace {

using ::testing::HasSubstr;

std::string error_of(const std::string& json) {
  try {
    parse_model_config(json, "cfg.json");
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

TEST(Config, RejectsHybridModelsByName) {
  EXPECT_THROW(load_model_config(test::data_path("configs/qwen3_next-transformers-default")), Error);
  EXPECT_THAT(error_of(R"({"model_type": "qwen3_next"})"), HasSubstr("model_type 'qwen3_next' is not supported"));
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
