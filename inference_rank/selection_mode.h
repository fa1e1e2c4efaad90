// How an inference rank selects the KV it attends past the sparse threshold (--selection): the modes shared by the
// CPU path (sparse_attention.h) and the GPU path (gpu_sparse.h, gpu_sync_selection.h). Plain C++17, so CUDA sources
// include it too.
#pragma once

#include <string>

namespace spade {

/// dense: full attention. oracle / quest: synchronous selection with the true query (token top-k / Quest-style page
/// top-k), the fidelity references. predicted: AsyncSpade through a cache rank.
enum class SelectionMode { Dense, Oracle, Predicted, Quest };
/// "dense" | "oracle" | "predicted" | "quest"; throws spade::Error listing them otherwise.
SelectionMode parse_selection_mode(const std::string& s);
const char* selection_mode_name(SelectionMode m);

}  // namespace spade
