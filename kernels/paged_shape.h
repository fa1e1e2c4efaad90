// Geometry of a launch over the paged KV cache: the one declaration of the batch / head / page fields that the
// paged-KV parameter structs of the CUDA launchers (attention.cuh, selection.cuh, layer_ops.cuh rope_kv_append) and
// of their CPU references (paged_attention_ref.h, sparse_attention_ref.h, selection_ref.h, kv_append_ref.h) carry.
// The structs derive from these, so a field is read as before (p.batch, p.page_size), and a caller that launches
// several kernels over the same pages builds the shape once and assigns it to each (kv_shape() / attention_shape()).
//
// Layout the fields describe (kernels/paged_attention_ref.h): k_cache / v_cache [num_pages, page_size, num_kv_heads,
// head_dim], block_table [batch, max_pages_per_seq] int32. Each launcher or reference states its own bounds and
// errors for them. Plain C++ header (no CUDA).
#pragma once

namespace spade::kernels {

/// The cache-side fields: which sequences, and how their pages are laid out.
struct PagedKvShape {
  int batch = 0;              // sequences: rows of block_table.
  int num_kv_heads = 0;       // KV heads of a page slot.
  int head_dim = 0;           // elements per K / V row.
  int page_size = 0;          // tokens per page.
  int max_pages_per_seq = 0;  // row length of block_table.

  /// These fields of a derived parameter struct, to set in one assignment: `p.kv_shape() = shape;`.
  PagedKvShape& kv_shape() { return *this; }
};

/// The cache-side fields plus the query heads: an attention launch. GQA: query head h reads KV head
/// h / (num_q_heads / num_kv_heads).
struct PagedAttentionShape : PagedKvShape {
  int num_q_heads = 0;

  /// These fields of a derived parameter struct, to set in one assignment: `p.attention_shape() = shape;`.
  PagedAttentionShape& attention_shape() { return *this; }
};

}  // namespace spade::kernels
