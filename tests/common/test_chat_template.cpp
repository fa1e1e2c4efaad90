// Tests for common/chat_template.h. Expected strings are derived by hand from the Jinja sources quoted next
// to them (transformers renders chat templates with Jinja2, trim_blocks and lstrip_blocks on).
#include "common/chat_template.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "common/error.h"
#include "common/tokenizer.h"
#include "tests/test_util.h"

namespace spade {
namespace {

using ::testing::HasSubstr;

const Tokenizer& qwen2() {
  static const Tokenizer tok = Tokenizer::from_dir(test::data_path("tokenizers/qwen2"));
  return tok;
}

const std::vector<ChatMessage> kTwoTurns = {
    {"user", "What is 1+1?"},
    {"assistant", "1+1 equals 2."},
    {"user", "And 2+2?"},
};

std::vector<ChatMessage> with_system(const std::string& system, std::vector<ChatMessage> m) {
  m.insert(m.begin(), ChatMessage{"system", system});
  return m;
}

// shared/data/tokenizers/qwen2/tokenizer_config.json "chat_template" (one line in the file):
//   {% set system_message = 'You are a helpful assistant.' %}
//   {% if messages[0]['role'] == 'system' %}{% set system_message = messages[0]['content'] %}{% endif %}
//   {% if system_message is defined %}{{ '<|im_start|>system\n' + system_message + '<|im_end|>\n' }}{% endif
//   %}
//   {% for message in messages %}{% set content = message['content'] %}
//     {% if message['role'] == 'user' %}{{ '<|im_start|>user\n' + content +
//     '<|im_end|>\n<|im_start|>assistant\n' }}
//     {% elif message['role'] == 'assistant' %}{{ content + '<|im_end|>' + '\n' }}{% endif %}
//   {% endfor %}
// So: the system block always comes first (default text unless messages[0] is a system message); each user
// turn opens the assistant turn itself; assistant turns are content + '<|im_end|>\n'; system messages in the
// loop print nothing; add_generation_prompt is not used.
TEST(ChatTemplateQwen2, RecognisesTheRealTemplate) {
  const ChatTemplate ct = ChatTemplate::for_tokenizer(qwen2());
  EXPECT_EQ(ct.kind(), ChatTemplateKind::kChatMLLegacy);
  EXPECT_EQ(ct.default_system_prompt(), "You are a helpful assistant.");
  EXPECT_EQ(chat_template_kind_name(ct.kind()), "chatml-legacy");
}

TEST(ChatTemplateQwen2, TwoTurnsWithoutSystemMessage) {
  const ChatTemplate ct = ChatTemplate::for_tokenizer(qwen2());
  EXPECT_EQ(ct.render(kTwoTurns),
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nWhat is 1+1?<|im_end|>\n<|im_start|>assistant\n"
            "1+1 equals 2.<|im_end|>\n"
            "<|im_start|>user\nAnd 2+2?<|im_end|>\n<|im_start|>assistant\n");
  // add_generation_prompt does not change this template's output.
  EXPECT_EQ(ct.render(kTwoTurns, {.add_generation_prompt = false, .enable_thinking = std::nullopt}),
            ct.render(kTwoTurns));
}

TEST(ChatTemplateQwen2, TwoTurnsWithSystemMessage) {
  const ChatTemplate ct = ChatTemplate::for_tokenizer(qwen2());
  EXPECT_EQ(ct.render(with_system("You are a terse math tutor.", kTwoTurns)),
            "<|im_start|>system\nYou are a terse math tutor.<|im_end|>\n"
            "<|im_start|>user\nWhat is 1+1?<|im_end|>\n<|im_start|>assistant\n"
            "1+1 equals 2.<|im_end|>\n"
            "<|im_start|>user\nAnd 2+2?<|im_end|>\n<|im_start|>assistant\n");
}

TEST(ChatTemplateQwen2, SingleQuestionMatchesRecordedTokenCount) {
  // prompts/../tokenizers/qwen2/SOURCES.md: apply_chat_template([{"role":"user","content":"What is 1+1?"}],
  // add_generation_prompt=True) "adds the default system prompt and returns 26 ids starting with 151644".
  const ChatTemplate ct = ChatTemplate::for_tokenizer(qwen2());
  const std::vector<ChatMessage> m = {{"user", "What is 1+1?"}};
  const std::vector<int32_t> ids = qwen2().encode(ct.render(m), true);
  EXPECT_EQ(ids.size(), 26u);
  EXPECT_EQ(ids.front(), 151644);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 151644), 3);  // system, user, assistant
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 151645), 2);
}

TEST(ChatTemplateQwen2, LaterSystemMessagesAreDroppedAsTheTemplateDoes) {
  const ChatTemplate ct = ChatTemplate::for_tokenizer(qwen2());
  const std::vector<ChatMessage> m = {{"user", "Hi"}, {"system", "ignored"}, {"assistant", "Hello"}};
  EXPECT_EQ(ct.render(m),
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n");
}

// Qwen2-1.5B-Instruct's upstream template (real newlines inside the literals, as in its
// tokenizer_config.json):
//   {% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}
//   {{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}
//   {{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}
//   {% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}
constexpr const char* kQwen2InstructTemplate =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ "
    "'<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|im_start|>assistant\n"
    "' }}{% endif %}";

TEST(ChatTemplateChatML, Qwen2InstructTemplate) {
  const ChatTemplate ct = ChatTemplate::from_source(kQwen2InstructTemplate, "test");
  EXPECT_EQ(ct.kind(), ChatTemplateKind::kChatML);
  EXPECT_EQ(ct.default_system_prompt(), "You are a helpful assistant.");
  EXPECT_EQ(ct.render(kTwoTurns),
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nWhat is 1+1?<|im_end|>\n"
            "<|im_start|>assistant\n1+1 equals 2.<|im_end|>\n"
            "<|im_start|>user\nAnd 2+2?<|im_end|>\n"
            "<|im_start|>assistant\n");
  EXPECT_EQ(ct.render(with_system("S", kTwoTurns),
                      {.add_generation_prompt = false, .enable_thinking = std::nullopt}),
            "<|im_start|>system\nS<|im_end|>\n"
            "<|im_start|>user\nWhat is 1+1?<|im_end|>\n"
            "<|im_start|>assistant\n1+1 equals 2.<|im_end|>\n"
            "<|im_start|>user\nAnd 2+2?<|im_end|>\n");
}

TEST(ChatTemplateChatML, EscapedNewlinesAndNoDefaultSystem) {
  // The same structure with Jinja "\n" escapes (backslash-n in the file) and no default system block.
  const char* src =
      R"({% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %})";
  const ChatTemplate ct = ChatTemplate::from_source(src, "test");
  EXPECT_EQ(ct.kind(), ChatTemplateKind::kChatML);
  EXPECT_EQ(ct.default_system_prompt(), "");
  const std::vector<ChatMessage> m = {{"user", "Hi"}};
  EXPECT_EQ(ct.render(m), "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
}

// Qwen3's chat_template (Apache-2.0), tools branch elided; "\n" are Jinja escapes as in its
// tokenizer_config.json.
constexpr const char* kQwen3Template = R"JINJA({%- if tools %}
    {{- '<|im_start|>system\n' }}
    {{- "# Tools (elided in this test)" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %})JINJA";

TEST(ChatTemplateQwen3, NoDefaultSystemAndThinkHandling) {
  const ChatTemplate ct = ChatTemplate::from_source(kQwen3Template, "qwen3");
  EXPECT_EQ(ct.kind(), ChatTemplateKind::kChatMLQwen3);
  // The history assistant turn (before the last user message) loses its <think> part.
  const std::vector<ChatMessage> m = {
      {"user", "What is 1+1?"},
      {"assistant", "<think>\nsimple\n</think>\n\n1+1 equals 2."},
      {"user", "And 2+2?"},
  };
  EXPECT_EQ(ct.render(m),
            "<|im_start|>user\nWhat is 1+1?<|im_end|>\n"
            "<|im_start|>assistant\n1+1 equals 2.<|im_end|>\n"
            "<|im_start|>user\nAnd 2+2?<|im_end|>\n"
            "<|im_start|>assistant\n");
  EXPECT_EQ(ct.render(m, {.add_generation_prompt = true, .enable_thinking = false}),
            "<|im_start|>user\nWhat is 1+1?<|im_end|>\n"
            "<|im_start|>assistant\n1+1 equals 2.<|im_end|>\n"
            "<|im_start|>user\nAnd 2+2?<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n");
  // A system message is used as given; a final assistant turn after the last user message gets a think block.
  const std::vector<ChatMessage> m2 = {{"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Hello"}};
  EXPECT_EQ(ct.render(m2, {.add_generation_prompt = false, .enable_thinking = std::nullopt}),
            "<|im_start|>system\nBe brief.<|im_end|>\n"
            "<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\nHello<|im_end|>\n");
}

TEST(ChatTemplatePlain, StoriesHasNoTemplate) {
  const Tokenizer stories = Tokenizer::from_dir(test::data_path("models/stories260K"));
  const ChatTemplate ct = ChatTemplate::for_tokenizer(stories);
  EXPECT_EQ(ct.kind(), ChatTemplateKind::kPlain);
  const std::vector<ChatMessage> m = {{"system", "Once upon"}, {"user", " a time"}};
  EXPECT_EQ(ct.render(m), "Once upon a time");
  EXPECT_EQ(stories.encode(ct.render(m), true), stories.encode("Once upon a time", true));
}

TEST(ChatTemplateErrors, UnrecognisedTemplatesAndBadMessages) {
  const char* llama3 =
      "{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + "
      "message['content'] | trim + '<|eot_id|>' }}{% endfor %}";
  try {
    ChatTemplate::from_source(llama3, "/m/tokenizer_config.json");
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("/m/tokenizer_config.json: unrecognised chat_template"));
    EXPECT_THAT(e.what(), HasSubstr("supported: no template"));
    EXPECT_THAT(e.what(), HasSubstr("Qwen3"));
  }
  const ChatTemplate ct = ChatTemplate::for_tokenizer(qwen2());
  EXPECT_THROW(ct.render(std::vector<ChatMessage>{}), Error);
  try {
    ct.render(std::vector<ChatMessage>{{"user", "x"}, {"tool", "{}"}});
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("messages[1] has role 'tool' (supported roles: system, user, assistant"));
    EXPECT_THAT(e.what(), HasSubstr("qwen2/tokenizer_config.json: chat template"));
  }
}

}  // namespace
}  // namespace spade
