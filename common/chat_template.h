// Chat prompt formatting without a Jinja engine. The chat_template of tokenizer_config.json is recognised as
// one of a few known families, and C++ code reproduces that family's output byte for byte for the inputs
// supported here.
//
// Supported inputs: a non-empty list of messages whose role is "system", "user" or "assistant" and whose
// content is plain text. Not supported: tools, tool calls and the "tool" role, multimodal content,
// `reasoning_content` fields, other template variables (bos_token, dates, ...).
//
// Recognised templates (ChatTemplateKind):
//   kPlain: no chat_template (e.g. stories260K). The contents concatenated in order; nothing added.
//   kChatMLLegacy: the older Qwen2 template that sets `system_message` (as in
//     shared/data/tokenizers/qwen2/tokenizer_config.json). Output:
//       '<|im_start|>system\n' + S + '<|im_end|>\n', where S is messages[0].content if messages[0] is a
//       system message, else the template's default ("You are a helpful assistant.");
//       then per message: user -> '<|im_start|>user\n' + content + '<|im_end|>\n<|im_start|>assistant\n';
//       assistant -> content + '<|im_end|>\n';
//       system -> nothing (a later system message is dropped, as the template does).
//     add_generation_prompt has no effect: the template opens the assistant turn after every user message.
//   kChatML: ChatML with add_generation_prompt (Qwen2-Instruct, Qwen2.5 without tools, plain ChatML). Output:
//       the default system block '<|im_start|>system\n' + D + '<|im_end|>\n' if messages[0] is not a system
//       message and the template has such a literal with non-empty D;
//       then per message '<|im_start|>' + role + '\n' + content + '<|im_end|>\n';
//       then '<|im_start|>assistant\n' if add_generation_prompt.
//   kChatMLQwen3: Qwen3 (no default system prompt; <think> handling). Output:
//       a first system message, user messages and later system messages as in kChatML;
//       an assistant message loses any '<think>...</think>' part of its content (content.split('</think>')
//       as in the template); after the last user message, if it is the last message or had reasoning, it is
//       written '<|im_start|>assistant\n<think>\n' + reasoning + '\n</think>\n\n' + content, else
//       '<|im_start|>assistant\n' + content; then '<|im_end|>\n';
//       add_generation_prompt appends '<|im_start|>assistant\n', plus '<think>\n\n</think>\n\n' when
//       enable_thinking is false.
// Anything else is an error that lists these kinds.
#pragma once

#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace spade {

class Tokenizer;

struct ChatMessage {
  std::string role;     // "system" | "user" | "assistant"
  std::string content;  // plain text (UTF-8)
};

enum class ChatTemplateKind { kPlain, kChatMLLegacy, kChatML, kChatMLQwen3 };

/// "plain", "chatml-legacy", "chatml", "chatml-qwen3".
std::string_view chat_template_kind_name(ChatTemplateKind kind);

struct ChatOptions {
  bool add_generation_prompt = true;
  std::optional<bool> enable_thinking;  // Qwen3 only; unset = the template's default (thinking allowed)
};

class ChatTemplate {
 public:
  /// Recognises `jinja_source` (empty = no template -> kPlain). `origin` (e.g. the tokenizer_config.json
  /// path) names it in errors. Throws spade::Error "<origin>: unrecognised chat_template ... supported: ..."
  /// otherwise.
  static ChatTemplate from_source(std::string_view jinja_source, const std::string& origin);
  /// from_source(tokenizer.chat_template(), the file it came from).
  static ChatTemplate for_tokenizer(const Tokenizer& tokenizer);
  /// from_source(the content of the Jinja file `path`, path). The file must be a regular file (a FIFO or directory is
  /// refused without blocking, common/file_read.h) of at most kMaxCheckpointJsonBytes; throws spade::Error naming it.
  static ChatTemplate from_file(const std::string& path);

  ChatTemplateKind kind() const { return kind_; }
  /// The default system prompt of kChatMLLegacy / kChatML templates ("" when there is none).
  const std::string& default_system_prompt() const { return default_system_; }

  /// The prompt text (to be encoded with add_special_tokens as the model expects; ChatML templates spell the
  /// special tokens in the text). Throws spade::Error for an empty list or a role other than
  /// system/user/assistant.
  std::string render(std::span<const ChatMessage> messages, const ChatOptions& options = {}) const;

 private:
  ChatTemplateKind kind_ = ChatTemplateKind::kPlain;
  std::string default_system_;
  std::string origin_;
};

}  // namespace spade
