// Tests for common/tokenizer.h on the real tokenizers in shared/data (Qwen2 byte-level BPE; stories260K
// SentencePiece-style BPE with byte fallback), plus synthetic tokenizer.json files for the error paths,
// added-token options and the byte-level demo layout.
#include "common/tokenizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "common/demo_tokenizer.h"
#include "common/error.h"
#include "tests/test_util.h"

namespace spade {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The Qwen2 tokenizer, loaded once for the whole binary (loading takes a fraction of a second).
const Tokenizer& qwen2() {
  static const Tokenizer tok = [] {
    const auto t0 = std::chrono::steady_clock::now();
    Tokenizer t = Tokenizer::from_dir(test::data_path("tokenizers/qwen2"));
    std::printf("[ info ] Qwen2 tokenizer loaded in %.3f s\n", seconds_since(t0));
    return t;
  }();
  return tok;
}

const Tokenizer& stories() {
  static const Tokenizer tok = Tokenizer::from_dir(test::data_path("models/stories260K"));
  return tok;
}

struct Vector {
  std::string source, text;
  std::vector<int32_t> ids;
};

std::vector<Vector> load_vectors(const std::string& rel, std::string* description) {
  const json j = json::parse(test::read_file(test::data_path(rel)));
  if (description != nullptr) *description = j.at("description").get<std::string>();
  std::vector<Vector> out;
  for (const json& v : j.at("vectors")) {
    out.push_back({v.at("source").get<std::string>(), v.at("text").get<std::string>(),
                   v.at("ids").get<std::vector<int32_t>>()});
  }
  return out;
}

// The prompt corpus, loaded as prompts/SOURCES.md says: `problem` for AIME and MATH500, `question` for GSM8K,
// each turn for MT-Bench, conversations[0].value for ShareGPT. (name, text) pairs; name = "<file>[<row>]".
std::vector<std::pair<std::string, std::string>> load_prompt_corpus() {
  std::vector<std::pair<std::string, std::string>> out;
  const std::string dir = test::data_path("prompts");
  auto jsonl = [&](const std::string& file, auto&& take) {
    std::istringstream in(test::read_file(dir + "/" + file));
    std::string line;
    size_t row = 0;
    while (std::getline(in, line)) {
      if (line.empty()) continue;
      take(json::parse(line), file + "[" + std::to_string(row++) + "]");
    }
  };
  auto field = [&](const char* key) {
    return [&out, key](const json& j, const std::string& name) {
      out.emplace_back(name, j.at(key).get<std::string>());
    };
  };
  jsonl("aime24.jsonl", field("problem"));
  jsonl("aime25.jsonl", field("problem"));
  jsonl("math500.jsonl", field("problem"));
  jsonl("gsm8k_test.jsonl", field("question"));
  jsonl("mt_bench_question.jsonl", [&](const json& j, const std::string& name) {
    for (size_t t = 0; t < j.at("turns").size(); ++t) {
      out.emplace_back(name + ".turns[" + std::to_string(t) + "]", j.at("turns")[t].get<std::string>());
    }
  });
  for (const char* file :
       {"sharegpt_v3_first_turn_1000.json", "sharegpt_sg90k_first_turn_2978_sorted.json"}) {
    const json arr = json::parse(test::read_file(dir + "/" + file));
    for (size_t i = 0; i < arr.size(); ++i) {
      out.emplace_back(std::string(file) + "[" + std::to_string(i) + "]",
                       arr[i].at("conversations").at(0).at("value").get<std::string>());
    }
  }
  return out;
}

const std::vector<std::pair<std::string, std::string>>& corpus() {
  static const auto c = load_prompt_corpus();
  return c;
}

std::string stream_all(const Tokenizer& tok, const std::vector<int32_t>& ids, bool skip_special,
                       std::vector<std::string>* pieces = nullptr) {
  StreamingDecoder sd(tok, skip_special);
  std::string all;
  for (int32_t id : ids) {
    std::string p = sd.push(id);
    if (pieces != nullptr) pieces->push_back(p);
    all += p;
  }
  std::string rest = sd.finish();
  if (pieces != nullptr) pieces->push_back(rest);
  return all + rest;
}

// ------------------------------------------------------------------------------------------------
// GPT-2 byte map
// ------------------------------------------------------------------------------------------------

TEST(Gpt2ByteToUnicode, MatchesGpt2Table) {
  const auto& t = gpt2_byte_to_unicode();
  EXPECT_EQ(t['A'], "A");
  EXPECT_EQ(t['!'], "!");
  EXPECT_EQ(t['~'], "~");
  EXPECT_EQ(t[0x00], "\u0100");
  EXPECT_EQ(t['\n'], "\u010A");  // Ċ
  EXPECT_EQ(t[' '], "\u0120");   // Ġ
  EXPECT_EQ(t[0x7F], "\u0121");
  EXPECT_EQ(t[0xA0], "\u0142");
  EXPECT_EQ(t[0xA1], "\u00A1");
  EXPECT_EQ(t[0xAD], "\u0143");  // the last of the 68 remapped bytes
  EXPECT_EQ(t[0xFF], "\u00FF");
  std::set<std::string> distinct(t.begin(), t.end());
  EXPECT_EQ(distinct.size(), 256u);
  // Every byte symbol is a single-token entry of the real Qwen2 vocabulary.
  for (int b = 0; b < 256; ++b) EXPECT_TRUE(qwen2().token_to_id(t[b]).has_value()) << "byte " << b;
}

// ------------------------------------------------------------------------------------------------
// Unicode normalization (expected strings computed with Python's unicodedata.normalize)
// ------------------------------------------------------------------------------------------------

TEST(Normalization, NfcComposesReordersAndRespectsExclusions) {
  EXPECT_EQ(nfc_normalize("cafe\u0301"), "caf\u00E9");
  EXPECT_EQ(nfc_normalize("\u212B"), "\u00C5");              // singleton ANGSTROM SIGN -> Å
  EXPECT_EQ(nfc_normalize("\u1100\u1161\u11A8"), "\uAC01");  // Hangul L V T -> LVT
  EXPECT_EQ(nfc_normalize("\uAC00\u11A8"), "\uAC01");        // LV + T
  EXPECT_EQ(nfc_normalize("\u0958"), "\u0915\u093C");        // composition exclusion stays decomposed
  EXPECT_EQ(nfc_normalize("\u1E0B\u0323"),
            "\u1E0D\u0307");  // reorder: dot below (220) before dot above (230)
  EXPECT_EQ(nfc_normalize("a\u0308\u0301"), "\u00E4\u0301");  // second mark blocked by the same class
  EXPECT_EQ(nfc_normalize("\u0344"), "\u0308\u0301");         // non-starter decomposition never recomposes
  EXPECT_EQ(nfc_normalize("\u0B47\u0B3E"), "\u0B4B");         // two starters compose
  EXPECT_EQ(nfc_normalize("\uF900"), "\u8C48");               // CJK compatibility ideograph (singleton)
  // Hebrew points are reordered by class (sharegpt_sg90k[319] is the one corpus text NFC changes):
  // BET + DAGESH (21) + PATAH (17) -> BET + PATAH + DAGESH; SHIN + SHIN DOT (24) + QAMATS (18) -> reordered.
  EXPECT_EQ(nfc_normalize("\u05D1\u05BC\u05B7"), "\u05D1\u05B7\u05BC");
  EXPECT_EQ(nfc_normalize("\u05E9\u05C1\u05B8"), "\u05E9\u05B8\u05C1");
  const std::string ascii_cjk = "plain ASCII, \u4F60\u597D, \uAC00";
  EXPECT_EQ(nfc_normalize(ascii_cjk), ascii_cjk);
  EXPECT_THROW(nfc_normalize("\xC3"), Error);
}

TEST(Normalization, NfdDecomposesFully) {
  EXPECT_EQ(nfd_normalize("\u00C5"), "A\u030A");
  EXPECT_EQ(nfd_normalize("\u1E69"), "s\u0323\u0307");  // two-step decomposition
  EXPECT_EQ(nfd_normalize("\uAC01"), "\u1100\u1161\u11A8");
  EXPECT_EQ(nfd_normalize("\u1E0B\u0323"), "d\u0323\u0307");
}

TEST(Utf8, LossyReplacesMaximalSubparts) {
  EXPECT_EQ(utf8_lossy("ok"), "ok");
  EXPECT_EQ(utf8_lossy("\xE4\xBD"), "\uFFFD");  // truncated 3-byte sequence: one U+FFFD
  EXPECT_EQ(utf8_lossy("\xE4\xBD"
                       "a"),
            "\uFFFD"
            "a");
  EXPECT_EQ(utf8_lossy("\x80\x80"), "\uFFFD\uFFFD");            // lone continuation bytes: one each
  EXPECT_EQ(utf8_lossy("\xED\xA0\x80"), "\uFFFD\uFFFD\uFFFD");  // surrogate: ED is a subpart, then A0, 80
  EXPECT_EQ(utf8_lossy("\xF0\x9F\x98\x80"), "\U0001F600");
  EXPECT_TRUE(is_valid_utf8("\u4F60"));
  EXPECT_FALSE(is_valid_utf8("\xC0\xAF"));  // overlong
}

// ------------------------------------------------------------------------------------------------
// Qwen2 (byte-level BPE)
// ------------------------------------------------------------------------------------------------

TEST(Qwen2Tokenizer, LoadsRealTokenizer) {
  const Tokenizer& t = qwen2();
  EXPECT_EQ(t.vocab_size(), 151646);
  EXPECT_EQ(t.token_to_id("<|endoftext|>"), 151643);
  EXPECT_EQ(t.token_to_id("<|im_start|>"), 151644);
  EXPECT_EQ(t.token_to_id("<|im_end|>"), 151645);
  EXPECT_EQ(t.id_to_token(9707), "Hello");
  EXPECT_EQ(t.id_to_token(151645), "<|im_end|>");
  EXPECT_FALSE(t.id_to_token(151646).has_value());
  EXPECT_FALSE(t.token_to_id("no such token").has_value());
  EXPECT_EQ(t.eos_id(), 151645);  // tokenizer_config.json: eos_token <|im_end|>
  EXPECT_FALSE(t.bos_id().has_value());
  EXPECT_TRUE(t.is_special(151643));
  EXPECT_FALSE(t.is_special(9707));
  EXPECT_TRUE(t.special_prefix_ids().empty());
  EXPECT_TRUE(t.special_suffix_ids().empty());
  EXPECT_THAT(t.chat_template(), HasSubstr("<|im_start|>"));
}

TEST(Qwen2Tokenizer, TestVectorsEncodeExactly) {
  std::string description;
  const auto vectors = load_vectors("tokenizers/qwen2/test_vectors.json", &description);
  // "NO bos/eos added": compare with add_special_tokens=false; Qwen2's post_processor adds nothing anyway.
  ASSERT_THAT(description, HasSubstr("NO bos/eos added"));
  ASSERT_EQ(vectors.size(), 38u);
  for (const Vector& v : vectors) {
    EXPECT_EQ(qwen2().encode(v.text, false), v.ids) << v.source << ": " << v.text.substr(0, 60);
    EXPECT_EQ(qwen2().encode(v.text, true), v.ids) << v.source;
  }
}

TEST(Qwen2Tokenizer, TestVectorsRoundTrip) {
  const auto vectors = load_vectors("tokenizers/qwen2/test_vectors.json", nullptr);
  int non_nfc = 0;
  for (const Vector& v : vectors) {
    const std::string back = qwen2().decode(qwen2().encode(v.text, false));
    if (nfc_normalize(v.text) == v.text) {
      EXPECT_EQ(back, v.text) << v.source;
    } else {
      // The decomposed "é" edge case: the NFC normalizer changes it, so it comes back composed.
      ++non_nfc;
      EXPECT_EQ(back, nfc_normalize(v.text)) << v.source;
      EXPECT_THAT(v.text, HasSubstr("e\u0301"));
    }
  }
  EXPECT_EQ(non_nfc, 1);
}

TEST(Qwen2Tokenizer, SpecialTokensInTextAreSingleIds) {
  const Tokenizer& t = qwen2();
  EXPECT_THAT(t.encode("<|im_start|>user\n", false), ElementsAre(151644, 872, 198));
  const std::vector<int32_t> ids = t.encode("<|im_start|>user\nhi<|im_end|>", false);
  ASSERT_GE(ids.size(), 5u);
  EXPECT_EQ(ids.front(), 151644);
  EXPECT_EQ(ids.back(), 151645);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 151644), 1);
  EXPECT_EQ(t.decode(std::vector<int32_t>(ids.begin() + 3, ids.end() - 1)), "hi");
  EXPECT_EQ(t.decode(ids), "<|im_start|>user\nhi<|im_end|>");
  EXPECT_EQ(t.decode(ids, /*skip_special_tokens=*/true), "user\nhi");
  // A partial special token is ordinary text.
  const std::vector<int32_t> partial = t.encode("<|im_start|", false);
  EXPECT_EQ(std::count(partial.begin(), partial.end(), 151644), 0);
  EXPECT_EQ(t.decode(partial), "<|im_start|");
}

TEST(Qwen2Tokenizer, RejectsInvalidUtf8AndNegativeIdsAndDropsIdsPastTheVocabulary) {
  try {
    qwen2().encode("ab\xFF", false);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("not valid UTF-8 (byte 2 of 3)"));
    EXPECT_THAT(e.what(), HasSubstr("tokenizer.json"));
  }
  // Ids past the tokenizer (the model's padded embedding rows, 151646..151935 for Qwen2) are dropped, as the
  // library's decode drops them; the text around them is unchanged. Negative ids are errors.
  const std::vector<int32_t> padded = {9707, 151646, 151919, 11, 1879};
  const std::vector<int32_t> known = {9707, 11, 1879};
  EXPECT_EQ(qwen2().decode(padded), qwen2().decode(known));
  EXPECT_EQ(qwen2().decode(padded), "Hello, world");
  try {
    qwen2().decode(std::vector<int32_t>{9707, -3});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("token id -3 is negative"));
    EXPECT_THAT(e.what(), HasSubstr("tokenizer.json"));
  }
  StreamingDecoder sd(qwen2());
  std::string streamed;
  for (int32_t id : padded) streamed += sd.push(id);
  streamed += sd.finish();
  EXPECT_EQ(streamed, "Hello, world");
  EXPECT_THROW(sd.push(-1), Error);
}

TEST(Qwen2Tokenizer, InvalidByteSequencesDecodeToReplacementCharacters) {
  const Tokenizer& t = qwen2();
  const auto& b2u = gpt2_byte_to_unicode();
  const int32_t cont = *t.token_to_id(b2u[0x80]);  // a lone continuation byte
  const int32_t lead = *t.token_to_id(b2u[0xE4]);  // a 3-byte lead byte
  const int32_t a = *t.token_to_id("a");
  EXPECT_EQ(t.decode(std::vector<int32_t>{cont}), "\uFFFD");
  EXPECT_EQ(t.decode(std::vector<int32_t>{lead, a}),
            "\uFFFD"
            "a");
  EXPECT_EQ(t.decode(std::vector<int32_t>{a, lead}), "a\uFFFD");
  for (const auto& ids :
       {std::vector<int32_t>{cont}, std::vector<int32_t>{lead, a}, std::vector<int32_t>{a, lead},
        std::vector<int32_t>{lead, cont, cont, lead, cont, a}}) {
    EXPECT_EQ(stream_all(t, ids, false), t.decode(ids));
  }
}

// All 6,017 prompt texts: the total token count equals the one recorded in prompts/SOURCES.md (computed with
// the tokenizers library and an independent Python BPE), and decode(encode(x)) == x except for the one text
// that NFC changes (sharegpt_sg90k[319]), which comes back in NFC form.
TEST(Qwen2Tokenizer, PromptCorpusCountsAndRoundTrips) {
  const auto& texts = corpus();
  ASSERT_EQ(texts.size(), 6017u);
  const Tokenizer& t = qwen2();
  size_t total = 0;
  std::vector<std::string> changed_by_nfc;
  std::vector<std::vector<int32_t>> all_ids;
  all_ids.reserve(texts.size());
  const auto t0 = std::chrono::steady_clock::now();
  for (const auto& [name, text] : texts) {
    all_ids.push_back(t.encode(text, false));
    total += all_ids.back().size();
  }
  const double enc_s = seconds_since(t0);
  const auto t1 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < texts.size(); ++i) {
    const auto& [name, text] = texts[i];
    const std::string back = t.decode(all_ids[i]);
    if (back != text) {
      changed_by_nfc.push_back(name);
      EXPECT_EQ(back, nfc_normalize(text)) << name;
    }
  }
  const double dec_s = seconds_since(t1);
  std::printf("[ info ] encoded %zu texts (%zu tokens) in %.3f s, decoded in %.3f s\n", texts.size(), total,
              enc_s, dec_s);
  EXPECT_EQ(total, 655942u);
  EXPECT_THAT(changed_by_nfc, ElementsAre("sharegpt_sg90k_first_turn_2978_sorted.json[319]"));
}

TEST(Qwen2Tokenizer, ConcurrentEncodeMatchesSequential) {
  // One instance shared by 4 threads (the BPE word cache is the only mutable state); a freshly loaded
  // tokenizer so that the threads also race on cache insertions.
  const Tokenizer t = Tokenizer::from_file(test::data_path("tokenizers/qwen2/tokenizer.json"));
  std::vector<std::string> texts;
  for (size_t i = 0; i < corpus().size(); i += 5) texts.push_back(corpus()[i].second);
  ASSERT_NE(texts.size() % 7919, 0u);
  std::vector<std::vector<std::vector<int32_t>>> results(4, std::vector<std::vector<int32_t>>(texts.size()));
  std::vector<std::thread> threads;
  for (size_t k = 0; k < results.size(); ++k) {
    threads.emplace_back([&, k] {
      for (size_t j = 0; j < texts.size(); ++j) {
        const size_t i =
            (j * 7919 + k * 301) % texts.size();  // a permutation (7919 is prime), shifted per thread
        results[k][i] = t.encode(texts[i], false);
      }
    });
  }
  for (auto& th : threads) th.join();
  for (size_t i = 0; i < texts.size(); ++i) {
    const std::vector<int32_t> expected = qwen2().encode(texts[i], false);
    for (size_t k = 0; k < results.size(); ++k)
      ASSERT_EQ(results[k][i], expected) << "thread " << k << " text " << i;
  }
}

TEST(Qwen2Tokenizer, StreamingEqualsFullDecodeOnNonAsciiPrompts) {
  const Tokenizer& t = qwen2();
  size_t checked = 0, held_back = 0;
  for (const auto& [name, text] : corpus()) {
    if (std::all_of(text.begin(), text.end(), [](char c) { return (c & 0x80) == 0; })) continue;
    const std::vector<int32_t> ids = t.encode(text, false);
    std::vector<std::string> pieces;
    ASSERT_EQ(stream_all(t, ids, false, &pieces), t.decode(ids)) << name;
    for (size_t i = 0; i < ids.size(); ++i) {
      ASSERT_TRUE(is_valid_utf8(pieces[i])) << name << " piece " << i;
      // A token whose bytes end inside a character yields less than its own text.
      if (pieces[i].empty()) ++held_back;
    }
    ++checked;
  }
  EXPECT_GT(checked, 400u);  // 493 corpus texts contain non-ASCII characters
  EXPECT_GT(held_back, 0u);  // some characters really were split across byte-level tokens
}

TEST(Qwen2Tokenizer, StreamingHoldsSplitCharacters) {
  // "emoji 😀👨‍👩‍👧": ZWJ (U+200D, E2 80 8D) is split over ids 378 (E2 80) and 235 (8D).
  const Tokenizer& t = qwen2();
  const std::vector<int32_t> ids = {37523, 90316, 145367, 378, 235, 145233, 378, 235, 145665};
  std::vector<std::string> pieces;
  EXPECT_EQ(stream_all(t, ids, false, &pieces), "emoji \U0001F600\U0001F468\u200D\U0001F469\u200D\U0001F467");
  EXPECT_EQ(pieces[3], "");        // E2 80: incomplete, held
  EXPECT_EQ(pieces[4], "\u200D");  // 8D completes it
  EXPECT_EQ(pieces.back(), "");    // nothing left for finish()
}

TEST(Qwen2Tokenizer, StreamingEqualsDecodeOnRandomIds) {
  const Tokenizer& t = qwen2();
  std::mt19937 rng(1234);
  const auto& b2u = gpt2_byte_to_unicode();
  std::vector<int32_t> byte_ids;
  for (int b = 0x80; b < 0x100; ++b) byte_ids.push_back(*t.token_to_id(b2u[b]));
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<int32_t> ids(1 + rng() % 40);
    for (int32_t& id : ids) {
      const uint32_t r = rng() % 10;
      if (r < 5) {
        id = byte_ids[rng() % byte_ids.size()];  // lone high bytes: mostly invalid sequences
      } else if (r < 6) {
        id = 151643 + static_cast<int32_t>(rng() % 3);
      } else {
        id = static_cast<int32_t>(rng() % 151643);
      }
    }
    for (bool skip : {false, true}) ASSERT_EQ(stream_all(t, ids, skip), t.decode(ids, skip)) << trial;
  }
}

// ------------------------------------------------------------------------------------------------
// stories260K (SentencePiece-style BPE, byte fallback)
// ------------------------------------------------------------------------------------------------

TEST(StoriesTokenizer, TestVectorsEncodeExactly) {
  std::string description;
  const auto vectors = load_vectors("models/stories260K/tokenizer_test_vectors.json", &description);
  // "bos=1, eos=0 ... with add_special_tokens=True": the ids include BOS.
  ASSERT_THAT(description, HasSubstr("add_special_tokens=True"));
  ASSERT_EQ(vectors.size(), 34u);
  const Tokenizer& t = stories();
  EXPECT_THAT(t.special_prefix_ids(), ElementsAre(1));
  for (const Vector& v : vectors) {
    EXPECT_EQ(t.encode(v.text, true), v.ids) << v.source << ": '" << v.text.substr(0, 60) << "'";
    ASSERT_FALSE(v.ids.empty());
    EXPECT_EQ(v.ids[0], 1);
    EXPECT_EQ(t.encode(v.text, false), std::vector<int32_t>(v.ids.begin() + 1, v.ids.end())) << v.source;
    EXPECT_EQ(t.decode(v.ids, /*skip_special_tokens=*/true), v.text) << v.source;
  }
}

TEST(StoriesTokenizer, ExpectedGreedyTextMatchesIds) {
  const Tokenizer& t = stories();
  const json ref =
      json::parse(test::read_file(test::data_path("models/stories260K/expected_greedy_200tok.ids.json")));
  const std::string text = test::read_file(test::data_path("models/stories260K/expected_greedy_200tok.txt"));
  const auto prompt = ref.at("prompt_ids").get<std::vector<int32_t>>();
  const auto gen = ref.at("generated_ids").get<std::vector<int32_t>>();
  ASSERT_THAT(prompt, ElementsAre(1));
  ASSERT_EQ(gen.size(), 200u);
  // The generated ids (no BOS) decode to the text; so do prompt + generated with the BOS skipped.
  EXPECT_EQ(t.decode(gen), text);
  std::vector<int32_t> all = prompt;
  all.insert(all.end(), gen.begin(), gen.end());
  EXPECT_EQ(t.decode(all, /*skip_special_tokens=*/true), text);
  // With the BOS kept the text starts with "<s>", so the decoder's Strip has no leading space to remove.
  EXPECT_EQ(t.decode(all, false), "<s> " + text);
  // Re-encoding the text with BOS gives back prompt + generated.
  EXPECT_EQ(t.encode(text, true), all);
  EXPECT_EQ(stream_all(t, gen, false), text);
  EXPECT_EQ(stream_all(t, all, true), text);
  EXPECT_EQ(stream_all(t, all, false), t.decode(all, false));
}

TEST(StoriesTokenizer, ConfigAndSpecials) {
  const Tokenizer& t = stories();
  EXPECT_EQ(t.vocab_size(), 512);
  EXPECT_EQ(t.bos_id(), 1);
  EXPECT_EQ(t.eos_id(), 2);
  EXPECT_EQ(t.add_bos_token(), true);
  EXPECT_EQ(t.add_eos_token(), false);
  EXPECT_TRUE(t.chat_template().empty());
  EXPECT_EQ(t.token_to_id("<0xE6>"), 3 + 0xE6);
  // "<s>" in the text is the special token, not characters.
  EXPECT_THAT(t.encode("<s>", false), ElementsAre(1));
  EXPECT_EQ(t.decode(std::vector<int32_t>{1, 2}, true), "");
}

TEST(StoriesTokenizer, ByteFallbackStreamingAndInvalidRuns) {
  const Tokenizer& t = stories();
  // "日本語" is all byte-fallback tokens after the "▁" prefix.
  const std::vector<int32_t> ids = t.encode("\u65E5\u672C\u8A9E", true);
  ASSERT_THAT(ids, ElementsAre(1, 410, 233, 154, 168, 233, 159, 175, 235, 173, 161));
  std::vector<std::string> pieces;
  EXPECT_EQ(stream_all(t, ids, true, &pieces), "\u65E5\u672C\u8A9E");
  for (size_t i = 0; i + 1 < pieces.size(); ++i) EXPECT_EQ(pieces[i], "") << i;  // the run is held ...
  EXPECT_EQ(pieces.back(), "\u65E5\u672C\u8A9E");                                // ... until finish()
  // A run that is not valid UTF-8 becomes one U+FFFD per byte token (the library's ByteFallback).
  const std::vector<int32_t> bad = {3 + 0xE6, 3 + 0x97, 261};  // E6 97 (truncated), then "▁a"
  EXPECT_EQ(t.decode(bad), "\uFFFD\uFFFD a");
  EXPECT_EQ(stream_all(t, bad, false), t.decode(bad));
  // The leading-space Strip applies once, to the start of the text.
  const std::vector<int32_t> two = t.encode("a a", false);
  EXPECT_EQ(t.decode(two), "a a");
  std::vector<std::string> p2;
  EXPECT_EQ(stream_all(t, two, false, &p2), "a a");
  EXPECT_EQ(p2.front(), "a");
}

TEST(StoriesTokenizer, StreamingEqualsDecodeOnCorpusAndRandomIds) {
  const Tokenizer& t = stories();
  size_t n = 0;
  for (const auto& [name, text] : corpus()) {
    if (text.size() > 2000 || n >= 1500) continue;
    const std::vector<int32_t> ids = t.encode(text, true);
    ASSERT_EQ(t.decode(ids, true), text) << name;
    ASSERT_EQ(stream_all(t, ids, true), text) << name;
    ASSERT_EQ(stream_all(t, ids, false), t.decode(ids, false)) << name;
    ++n;
  }
  std::mt19937 rng(99);
  for (int trial = 0; trial < 500; ++trial) {
    std::vector<int32_t> ids(1 + rng() % 30);
    for (int32_t& id : ids) id = static_cast<int32_t>(rng() % 2 ? 3 + rng() % 256 : rng() % 512);
    for (bool skip : {false, true}) ASSERT_EQ(stream_all(t, ids, skip), t.decode(ids, skip)) << trial;
  }
}

// ------------------------------------------------------------------------------------------------
// Synthetic tokenizer.json files
// ------------------------------------------------------------------------------------------------

TEST(ByteLevelDemoTokenizer, LoadsAndRoundTrips) {
  const std::string dir = test::make_temp_dir("spade_tok_");
  const std::string path = dir + "/tokenizer.json";
  {
    std::ofstream f(path);
    f << demo_byte_level_tokenizer_json();  // the layout make_demo_checkpoint writes
  }
  const Tokenizer t = Tokenizer::from_file(path);
  EXPECT_EQ(t.vocab_size(), 259);
  const std::string text = "Hi \u4F60\u597D \U0001F600!\n";
  const std::vector<int32_t> ids = t.encode(text, true);
  ASSERT_EQ(ids.size(), text.size());  // one id per byte, id = byte value
  for (size_t i = 0; i < text.size(); ++i) EXPECT_EQ(ids[i], static_cast<unsigned char>(text[i]));
  EXPECT_EQ(t.decode(ids), text);
  EXPECT_EQ(stream_all(t, ids, false), text);
  EXPECT_THAT(t.encode("<|im_start|>user\n<|im_end|>", false),
              ElementsAre(257, 'u', 's', 'e', 'r', '\n', 258));
  EXPECT_EQ(t.decode(std::vector<int32_t>{257, 'h', 'i', 258}, true), "hi");
  // The NFC normalizer runs before the byte split: a decomposed e + U+0301 becomes the two bytes of U+00E9.
  EXPECT_THAT(t.encode("cafe\u0301", false), ElementsAre('c', 'a', 'f', 0xC3, 0xA9));
  for (size_t i = 0; i < corpus().size(); i += 97) {
    const std::string& s = corpus()[i].second;
    EXPECT_EQ(t.decode(t.encode(s, false)), nfc_normalize(s)) << corpus()[i].first;
  }
  fs::remove_all(dir);
}

// A small SentencePiece-like BPE over a few characters, for added-token options.
json tiny_json(json added_tokens, json normalizer = nullptr) {
  json vocab = {{"<unk>", 0}, {"a", 1},  {"b", 2},      {" ", 3}, {"ab", 4}, {"m", 5},
                {"y", 6},     {"my", 7}, {"<mask>", 8}, {"x", 9}, {"\t", 10}};
  return {{"added_tokens", added_tokens},
          {"normalizer", normalizer},
          {"pre_tokenizer", nullptr},
          {"post_processor", nullptr},
          {"decoder", {{"type", "Fuse"}}},
          {"model",
           {{"type", "BPE"},
            {"unk_token", "<unk>"},
            {"fuse_unk", true},
            {"vocab", vocab},
            {"merges", json::array({"a b", json::array({"m", "y"})})}}}};
}

json added(int id, const std::string& content, bool lstrip, bool rstrip, bool single_word, bool normalized,
           bool special) {
  return {{"id", id},          {"content", content},         {"lstrip", lstrip},
          {"rstrip", rstrip},  {"single_word", single_word}, {"normalized", normalized},
          {"special", special}};
}

TEST(SyntheticTokenizer, MergesUnkAndAddedTokenOptions) {
  const Tokenizer plain = Tokenizer::from_json_text(tiny_json(json::array()).dump(), "tiny.json");
  EXPECT_THAT(plain.encode("ab a b", false), ElementsAre(4, 3, 1, 3, 2));
  EXPECT_THAT(plain.encode("abzzb", false), ElementsAre(4, 0, 2));  // fuse_unk: "zz" is one <unk>
  EXPECT_EQ(plain.decode(std::vector<int32_t>{4, 3, 7}), "ab my");  // Fuse decoder: concatenation

  // lstrip + rstrip swallow the surrounding whitespace (including a tab); single_word needs word boundaries.
  const Tokenizer t =
      Tokenizer::from_json_text(tiny_json(json::array({added(7, "my", true, true, false, false, false),
                                                       added(8, "<mask>", false, false, true, false, true)}))
                                    .dump(),
                                "tiny.json");
  EXPECT_THAT(t.encode("ab my\tab", false), ElementsAre(4, 7, 4));
  EXPECT_THAT(t.encode("a <mask> b", false), ElementsAre(1, 3, 8, 3, 2));
  // Not a single word: plain characters ('<', 's', 'k', '>' are <unk>, fused when adjacent).
  EXPECT_THAT(t.encode("a<mask>", false), ElementsAre(1, 0, 5, 1, 0));
  EXPECT_EQ(t.decode(std::vector<int32_t>{1, 8, 2}, true), "ab");

  // normalized=true tokens are matched after the normalizer (here Replace "x" -> "m"), raw ones before it.
  const Tokenizer n = Tokenizer::from_json_text(
      tiny_json(json::array({added(7, "my", false, false, false, true, false)}),
                {{"type", "Replace"}, {"pattern", {{"String", "x"}}}, {"content", "m"}})
          .dump(),
      "tiny.json");
  EXPECT_THAT(n.encode("xyab", false), ElementsAre(7, 4));
}

// ------------------------------------------------------------------------------------------------
// Malformed files: each error names the file and the field
// ------------------------------------------------------------------------------------------------

std::string load_error(const std::string& text) {
  try {
    Tokenizer::from_json_text(text, "/x/tokenizer.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(TokenizerErrors, MalformedJsonFiles) {
  EXPECT_THAT(load_error("{\"model\": "), HasSubstr("/x/tokenizer.json: not valid JSON"));
  EXPECT_THAT(load_error("[1, 2]"), HasSubstr("/x/tokenizer.json: the top level must be a JSON object"));
  EXPECT_EQ(load_error("{\"version\": \"1.0\"}"), "/x/tokenizer.json: model is missing");

  json j = tiny_json(json::array());
  j["model"]["type"] = "Unigram";
  EXPECT_EQ(load_error(j.dump()), "/x/tokenizer.json: model.type 'Unigram' is not supported (BPE only)");

  j = tiny_json(json::array());
  j["model"]["merges"] = json::array({"a b", "m y", "a xyz"});
  EXPECT_EQ(load_error(j.dump()), "/x/tokenizer.json: model.merges[2] refers to unknown token 'xyz'");

  j = tiny_json(json::array());
  j["model"]["merges"] = json::array({json::array({"b", "a"})});
  EXPECT_EQ(load_error(j.dump()),
            "/x/tokenizer.json: model.merges[0] ('b', 'a') produces 'ba', which is not in model.vocab");

  j = tiny_json(json::array());
  j["model"]["merges"] = json::array({"a b c"});
  EXPECT_THAT(load_error(j.dump()), HasSubstr("model.merges[0] 'a b c' is not of the form 'a b'"));

  j = tiny_json(json::array());
  j["model"]["merges"] = json::array({json::array({"a"})});
  EXPECT_THAT(load_error(j.dump()), HasSubstr("model.merges[0] must be a pair of two strings [a, b]"));

  j = tiny_json(json::array());
  j["model"]["vocab"]["z"] = "seven";
  EXPECT_THAT(load_error(j.dump()), HasSubstr("/x/tokenizer.json: model.vocab['z'] must be an integer id"));

  j = tiny_json(json::array());
  j["model"]["vocab"]["z"] = 1;
  EXPECT_EQ(load_error(j.dump()), "/x/tokenizer.json: model.vocab id 1 is used by both 'a' and 'z'");

  j = tiny_json(json::array());
  j["model"].erase("merges");
  EXPECT_EQ(load_error(j.dump()), "/x/tokenizer.json: model.merges is missing");

  j = tiny_json(json::array());
  j["model"]["unk_token"] = "[UNK]";
  EXPECT_EQ(load_error(j.dump()), "/x/tokenizer.json: model.unk_token '[UNK]' is not in model.vocab");

  j = tiny_json(json::array());
  j["model"]["dropout"] = 0.1;
  EXPECT_THAT(load_error(j.dump()), HasSubstr("model.dropout 0.1 is not supported"));
}

TEST(TokenizerErrors, AddedTokenClashes) {
  // Same id as a different model token.
  EXPECT_EQ(load_error(tiny_json(json::array({added(1, "<new>", false, false, false, false, true)})).dump()),
            "/x/tokenizer.json: added_tokens[0] '<new>' has id 1, which is model.vocab token 'a'");
  // Content of a model token with another id.
  EXPECT_EQ(load_error(tiny_json(json::array({added(20, "ab", false, false, false, false, true)})).dump()),
            "/x/tokenizer.json: added_tokens[0] 'ab' has id 20 but model.vocab has it as id 4");
  // Two added tokens with one id.
  EXPECT_EQ(load_error(tiny_json(json::array({added(20, "<p>", false, false, false, false, true),
                                              added(20, "<q>", false, false, false, false, true)}))
                           .dump()),
            "/x/tokenizer.json: added_tokens[1] '<q>' has id 20, already used by added_tokens[0] '<p>'");
  // The same content twice.
  EXPECT_EQ(load_error(tiny_json(json::array({added(20, "<p>", false, false, false, false, true),
                                              added(21, "<p>", false, false, false, false, true)}))
                           .dump()),
            "/x/tokenizer.json: added_tokens[1] '<p>' is already added_tokens[0]");
}

TEST(TokenizerErrors, UnsupportedComponentsAndFiles) {
  json j = tiny_json(json::array(), {{"type", "Lowercase"}});
  EXPECT_EQ(load_error(j.dump()),
            "/x/tokenizer.json: normalizer.type 'Lowercase' is not supported (supported: NFC, NFD, Prepend, "
            "Replace, Sequence)");
  j = tiny_json(json::array());
  j["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", json::array({{{"type", "Whitespace"}}})}};
  EXPECT_THAT(load_error(j.dump()),
              HasSubstr("pre_tokenizer.pretokenizers[0].type 'Whitespace' is not supported"));
  j = tiny_json(json::array());
  j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "(a"}}}, {"behavior", "Isolated"}};
  EXPECT_THAT(load_error(j.dump()), HasSubstr("pre_tokenizer.pattern.Regex: regex '(a' does not compile"));
  j = tiny_json(json::array());
  j["decoder"] = {{"type", "Sequence"},
                  {"decoders", json::array({{{"type", "Fuse"}}, {{"type", "ByteFallback"}}})}};
  EXPECT_THAT(load_error(j.dump()), HasSubstr("decoder.decoders[1] ByteFallback after a Fuse"));
  j = tiny_json(json::array());
  j["post_processor"] = {{"type", "TemplateProcessing"},
                         {"single", json::array({{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                                                 {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
                         {"special_tokens", json::object()}};
  EXPECT_THAT(load_error(j.dump()), HasSubstr("post_processor.single[0].SpecialToken.id '<s>' is not in"));

  try {
    Tokenizer::from_file("/nonexistent/tokenizer.json");
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("/nonexistent/tokenizer.json: cannot open tokenizer.json"));
  }
  const std::string dir = test::make_temp_dir("spade_tok_");
  try {
    Tokenizer::from_dir(dir);
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("tokenizer.json is required but missing"));
  }
  {
    std::ofstream(dir + "/tokenizer.json") << tiny_json(json::array()).dump();
    std::ofstream(dir + "/tokenizer_config.json") << R"({"bos_token": "<s>"})";
  }
  try {
    Tokenizer::from_dir(dir);
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(),
                HasSubstr(dir + "/tokenizer_config.json: bos_token '<s>' is not in the vocabulary"));
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace spade
