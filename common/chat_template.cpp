// Chat templates without Jinja — see chat_template.h for the recognised families and their exact output.
#include "common/chat_template.h"

#include <algorithm>

#include "common/error.h"
#include "common/file_read.h"
#include "common/tokenizer.h"

namespace spade {

namespace {

constexpr std::string_view kSupported =
    "supported: no template (plain concatenation); ChatML that sets system_message (older Qwen2); ChatML "
    "with "
    "add_generation_prompt and an optional default system prompt (Qwen2-Instruct, Qwen2.5, plain ChatML); "
    "Qwen3 "
    "ChatML with <think> handling";

void replace_all(std::string& s, std::string_view from, std::string_view to) {
  size_t pos = 0;
  while ((pos = s.find(from, pos)) != std::string::npos) {
    s.replace(pos, from.size(), to);
    pos += to.size();
  }
}

// The template text with Jinja "\n" escapes turned into newlines (some tokenizer_config.json files hold real
// newlines inside the template's string literals, others the two characters backslash + n).
std::string unescape_newlines(std::string_view src) {
  std::string s(src);
  replace_all(s, "\\n", "\n");
  return s;
}

// A form of the template for recognising its structure: newline escapes resolved, whitespace control removed,
// quotes unified, attribute access spelled as subscripts, and all whitespace dropped.
std::string canonical_form(std::string_view src) {
  std::string s = unescape_newlines(src);
  replace_all(s, "{%-", "{%");
  replace_all(s, "-%}", "%}");
  replace_all(s, "{{-", "{{");
  replace_all(s, "-}}", "}}");
  std::replace(s.begin(), s.end(), '"', '\'');
  replace_all(s, ".role", "['role']");
  replace_all(s, ".content", "['content']");
  s.erase(std::remove_if(s.begin(), s.end(),
                         [](char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }),
          s.end());
  return s;
}

bool contains(std::string_view s, std::string_view what) {
  return s.find(what) != std::string_view::npos;
}

// The Jinja string literal starting at s[pos] (a quote), with \\, \', \" and \n unescaped; nullopt if none.
std::optional<std::string> string_literal_at(std::string_view s, size_t pos) {
  if (pos >= s.size() || (s[pos] != '\'' && s[pos] != '"')) return std::nullopt;
  const char q = s[pos];
  std::string out;
  for (size_t i = pos + 1; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 1 < s.size()) {
      const char e = s[++i];
      out.push_back(e == 'n' ? '\n' : e);
    } else if (s[i] == q) {
      return out;
    } else {
      out.push_back(s[i]);
    }
  }
  return std::nullopt;
}

// `{% set system_message = '...' %}` -> the literal.
std::optional<std::string> legacy_default_system(std::string_view src) {
  size_t pos = src.find("system_message");
  while (pos != std::string_view::npos) {
    size_t i = pos + std::string_view("system_message").size();
    while (i < src.size() && src[i] == ' ') ++i;
    if (i < src.size() && src[i] == '=') {
      ++i;
      while (i < src.size() && src[i] == ' ') ++i;
      if (auto lit = string_literal_at(src, i)) return lit;
    }
    pos = src.find("system_message", pos + 1);
  }
  return std::nullopt;
}

// The first string literal of the form '<|im_start|>system\n' + S + '<|im_end|>\n' with non-empty S -> S.
std::string chatml_default_system(std::string_view src) {
  constexpr std::string_view kHead = "<|im_start|>system\n";
  constexpr std::string_view kTail = "<|im_end|>\n";
  for (size_t pos = src.find(kHead); pos != std::string_view::npos; pos = src.find(kHead, pos + 1)) {
    if (pos == 0 || (src[pos - 1] != '\'' && src[pos - 1] != '"')) continue;
    const std::optional<std::string> lit = string_literal_at(src, pos - 1);
    if (!lit || lit->size() <= kHead.size() + kTail.size()) continue;
    if (lit->compare(lit->size() - kTail.size(), kTail.size(), kTail) != 0) continue;
    return lit->substr(kHead.size(), lit->size() - kHead.size() - kTail.size());
  }
  return std::string();
}

void check_messages(std::span<const ChatMessage> messages, const std::string& origin) {
  if (messages.empty()) fail("{}: chat template: the message list is empty", origin);
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string& r = messages[i].role;
    if (r != "system" && r != "user" && r != "assistant") {
      fail(
          "{}: chat template: messages[{}] has role '{}' (supported roles: system, user, assistant; no "
          "tools)",
          origin, i, r);
    }
  }
}

// Python str helpers used by the Qwen3 template.
std::string_view rstrip_nl(std::string_view s) {
  while (!s.empty() && s.back() == '\n') s.remove_suffix(1);
  return s;
}
std::string_view lstrip_nl(std::string_view s) {
  while (!s.empty() && s.front() == '\n') s.remove_prefix(1);
  return s;
}
bool starts_with(std::string_view s, std::string_view p) {
  return s.substr(0, p.size()) == p;
}
bool ends_with(std::string_view s, std::string_view p) {
  return s.size() >= p.size() && s.substr(s.size() - p.size()) == p;
}

std::string render_qwen3(std::span<const ChatMessage> m, const ChatOptions& opt) {
  std::string out;
  if (m[0].role == "system") out += "<|im_start|>system\n" + m[0].content + "<|im_end|>\n";
  // ns.last_query_index: the last user message that is not a wrapped tool response.
  size_t last_query = m.size() - 1;
  for (size_t k = m.size(); k-- > 0;) {
    const std::string& c = m[k].content;
    if (m[k].role == "user" && !(starts_with(c, "<tool_response>") && ends_with(c, "</tool_response>"))) {
      last_query = k;
      break;
    }
  }
  for (size_t i = 0; i < m.size(); ++i) {
    const ChatMessage& msg = m[i];
    if (msg.role == "user" || (msg.role == "system" && i != 0)) {
      out += "<|im_start|>" + msg.role + "\n" + msg.content + "<|im_end|>\n";
    } else if (msg.role == "assistant") {
      std::string_view content = msg.content;
      std::string_view reasoning;
      const size_t close = content.find("</think>");
      if (close != std::string_view::npos) {
        // content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n')
        std::string_view before = rstrip_nl(content.substr(0, close));
        const size_t open = before.rfind("<think>");
        if (open != std::string_view::npos) before = before.substr(open + std::string_view("<think>").size());
        reasoning = lstrip_nl(before);
        // content.split('</think>')[-1].lstrip('\n')
        const size_t last_close = content.rfind("</think>");
        content = lstrip_nl(content.substr(last_close + std::string_view("</think>").size()));
      }
      const bool last = i + 1 == m.size();
      if (i > last_query && (last || !reasoning.empty())) {
        // reasoning_content.strip('\n')
        std::string_view r = lstrip_nl(rstrip_nl(reasoning));
        out += "<|im_start|>assistant\n<think>\n";
        out += r;
        out += "\n</think>\n\n";
        out += lstrip_nl(content);
      } else {
        out += "<|im_start|>assistant\n";
        out += content;
      }
      out += "<|im_end|>\n";
    }
  }
  if (opt.add_generation_prompt) {
    out += "<|im_start|>assistant\n";
    if (opt.enable_thinking.has_value() && !*opt.enable_thinking) out += "<think>\n\n</think>\n\n";
  }
  return out;
}

}  // namespace

std::string_view chat_template_kind_name(ChatTemplateKind kind) {
  switch (kind) {
    case ChatTemplateKind::kPlain:
      return "plain";
    case ChatTemplateKind::kChatMLLegacy:
      return "chatml-legacy";
    case ChatTemplateKind::kChatML:
      return "chatml";
    case ChatTemplateKind::kChatMLQwen3:
      return "chatml-qwen3";
  }
  return "?";
}

ChatTemplate ChatTemplate::from_source(std::string_view src, const std::string& origin) {
  ChatTemplate t;
  t.origin_ = origin;
  if (src.find_first_not_of(" \t\r\n") == std::string_view::npos) {
    t.kind_ = ChatTemplateKind::kPlain;
    return t;
  }
  const std::string canon = canonical_form(src);
  const std::string unescaped = unescape_newlines(src);
  const bool chatml = contains(canon, "<|im_start|>") && contains(canon, "<|im_end|>");
  const bool role_header = contains(canon, "'<|im_start|>'+message['role']+'");
  const bool gen_prompt =
      contains(canon, "add_generation_prompt") && contains(canon, "'<|im_start|>assistant");

  if (chatml && contains(canon, "{%setsystem_message=") && !contains(canon, "add_generation_prompt") &&
      contains(canon, "'<|im_start|>user'+content+'<|im_end|><|im_start|>assistant'") &&
      contains(canon, "content+'<|im_end|>'")) {
    const std::optional<std::string> def = legacy_default_system(unescaped);
    if (!def) fail("{}: chat_template sets system_message but its value is not a string literal", origin);
    t.kind_ = ChatTemplateKind::kChatMLLegacy;
    t.default_system_ = *def;
    return t;
  }
  if (chatml && role_header && gen_prompt && contains(canon, "</think>") &&
      contains(canon, "last_query_index") && contains(canon, "enable_thinking")) {
    t.kind_ = ChatTemplateKind::kChatMLQwen3;
    return t;
  }
  if (chatml && role_header && gen_prompt && !contains(canon, "<think>") && !contains(canon, "</think>")) {
    t.kind_ = ChatTemplateKind::kChatML;
    t.default_system_ = chatml_default_system(unescaped);
    return t;
  }
  fail("{}: unrecognised chat_template (it is not run as Jinja; {}). Its first 120 characters: '{}'", origin,
       kSupported, src.substr(0, 120));
}

ChatTemplate ChatTemplate::from_file(const std::string& path) {
  return from_source(read_regular_file(path, "a chat template file", kMaxCheckpointJsonBytes), path);
}

ChatTemplate ChatTemplate::for_tokenizer(const Tokenizer& tokenizer) {
  const std::string& origin =
      tokenizer.chat_template_source().empty() ? tokenizer.source() : tokenizer.chat_template_source();
  return from_source(tokenizer.chat_template(), origin);
}

std::string ChatTemplate::render(std::span<const ChatMessage> m, const ChatOptions& opt) const {
  check_messages(m, origin_);
  std::string out;
  switch (kind_) {
    case ChatTemplateKind::kPlain:
      for (const ChatMessage& msg : m) out += msg.content;
      return out;
    case ChatTemplateKind::kChatMLLegacy: {
      const std::string& system = m[0].role == "system" ? m[0].content : default_system_;
      out += "<|im_start|>system\n" + system + "<|im_end|>\n";
      for (const ChatMessage& msg : m) {
        if (msg.role == "user") {
          out += "<|im_start|>user\n" + msg.content + "<|im_end|>\n<|im_start|>assistant\n";
        } else if (msg.role == "assistant") {
          out += msg.content + "<|im_end|>\n";
        }
      }
      return out;
    }
    case ChatTemplateKind::kChatML:
      if (m[0].role != "system" && !default_system_.empty()) {
        out += "<|im_start|>system\n" + default_system_ + "<|im_end|>\n";
      }
      for (const ChatMessage& msg : m) out += "<|im_start|>" + msg.role + "\n" + msg.content + "<|im_end|>\n";
      if (opt.add_generation_prompt) out += "<|im_start|>assistant\n";
      return out;
    case ChatTemplateKind::kChatMLQwen3:
      return render_qwen3(m, opt);
  }
  return out;
}

}  // namespace spade
