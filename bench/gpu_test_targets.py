#!/usr/bin/env python3
"""Prints the build targets of the gpu tests that `ctest --show-only=json-v1` lists on stdin, one per line.

ctest names a test's executable only once it has been built, so on a fresh build folder the test's name stands for
its target (tests/CMakeLists.txt: one executable per test, named like the test). A ctest entry that runs another
entry's executable with a gtest filter is named <that target minus "_gpu">_2gpu_gpu (tests/inference_rank/
CMakeLists.txt) and maps to it. A test run by an interpreter (python3 bench/fidelity/passkey_gpu.py --inference-rank
PATH ...) maps to the build targets its arguments name. Usage (in the build folder): ctest --show-only=json-v1 -L gpu | gpu_test_targets.py
"""
import json
import os
import subprocess
import sys

targets = {line.split(":", 1)[0] for line in
           subprocess.run(["ninja", "-t", "targets", "all"], capture_output=True, text=True, check=True).stdout.splitlines()}
out = set()
for t in json.load(sys.stdin)["tests"]:
    cmd = t.get("command")
    candidates = [os.path.basename(cmd[0])] if cmd else [t["name"], t["name"].replace("_2gpu_gpu", "_gpu")]
    exe = next((c for c in candidates if c in targets), None)
    if exe is None and cmd and os.path.basename(cmd[0]).startswith("python"):
        named = [os.path.basename(a) for a in cmd[1:] if os.path.basename(a) in targets]
        if named:
            out.update(named)
            continue
    if exe is None:
        sys.exit(f"gpu_test_targets: no build target for ctest entry {t['name']} (tried {candidates})")
    out.add(exe)
print("\n".join(sorted(out)))
