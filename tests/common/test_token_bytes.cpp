// Tokenizer::token_bytes (OpenAI's logprobs `bytes`): the exact bytes each token contributes to decoded text. On a
// byte-level BPE (Qwen2) the tokens' bytes concatenate to the text byte for byte, a CJK character split across tokens
// gives each token part of its UTF-8 sequence; on a SentencePiece-style tokenizer with byte fallback (stories260K)
// "▁" is a space and <0xNN> tokens are their byte; unknown ids give "".
#include <gtest/gtest.h>

#include <string>

#include "common/tokenizer.h"
#include "tests/test_util.h"

namespace spade {
namespace {

std::string concat_bytes(const Tokenizer& tok, const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t id : ids) s += tok.token_bytes(id);
  return s;
}

TEST(TokenBytes, ByteLevelTokensConcatenateToTheTextAndMaySplitACharacter) {
  const Tokenizer tok = Tokenizer::from_file(test::data_path("tokenizers/qwen2/tokenizer.json"));
  const std::string text = "Hello wörld, 日本語の文章 🦙 tab\tend";
  const std::vector<int32_t> ids = tok.encode(text, false);
  EXPECT_EQ(concat_bytes(tok, ids), text);
  bool split = false;  // some token holds part of a multi-byte character (its bytes alone are not valid UTF-8)
  for (int32_t id : ids) split = split || !is_valid_utf8(tok.token_bytes(id));
  EXPECT_TRUE(split) << "expected the emoji or a CJK character to span tokens";
  EXPECT_EQ(tok.token_bytes(tok.encode(" the", false).at(0)), " the");
  EXPECT_EQ(tok.token_bytes(tok.vocab_size() + 5), "");
}

TEST(TokenBytes, SentencePieceByteFallbackTokensAreTheirBytes) {
  const Tokenizer tok = Tokenizer::from_file(test::data_path("models/stories260K/tokenizer.json"));
  const std::string text = "Once upon a time, a cat ate ü";
  const std::vector<int32_t> ids = tok.encode(text, false);
  // The decoder's Strip removes the one leading space of the whole text; per token it is kept.
  EXPECT_EQ(concat_bytes(tok, ids), " " + text);
  const auto b = tok.token_to_id("<0xC3>");
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(tok.token_bytes(*b), "\xC3");
}

}  // namespace
}  // namespace spade
