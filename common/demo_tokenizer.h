// The tokenizer of Spade's demo checkpoints (inference_rank/make_demo_checkpoint writes it; the tokenizer tests
// load it): a byte-level BPE with one token per byte and no merges.
#pragma once

#include <string>

namespace spade {

/// The `tokenizer.json` text (Hugging Face tokenizers format, 2-space indented JSON) of the demo byte-level BPE:
/// vocab = the 256 GPT-2 byte symbols (gpt2_byte_to_unicode; id = byte value), no merges; NFC normalizer; Qwen2
/// pre-tokenizer (Split on the Qwen2 regex, Isolated, then ByteLevel without its own regex); ByteLevel
/// post-processor and decoder; added tokens 256 "<|endoftext|>", 257 "<|im_start|>", 258 "<|im_end|>" (special,
/// not normalized). Vocabulary size 259. Deterministic: the same text on every call.
std::string demo_byte_level_tokenizer_json();

}  // namespace spade
