#!/usr/bin/env python3
"""Checks psflow's lock annotations with Clang's thread-safety analysis.

  scripts/check-thread-safety.py BUILD_DIR [-j JOBS] [--all] [FILE...]

Runs `clang++-14 -fsyntax-only -Wthread-safety -Werror=thread-safety` over the
psflow .cc files in BUILD_DIR/compile_commands.json (generated code and .cu files
left out; FILE... narrows the set), with the include directories, defines and
-std of each file's own compile command. The tree is built with GCC, which
ignores ABSL_GUARDED_BY and friends; this is what makes them more than comments.

The analysis can only find something in a file where a lock or an annotation
appears: in the file itself or in a psflow header it includes, directly or not
(absl::Mutex and its lock guards, ABSL_GUARDED_BY, ABSL_*_LOCKS_*, ...). Files
with none of those are not compiled, which keeps the check fast; --all
compiles every file anyway.

Exit status: 0 when every file is clean, 1 when any file has a thread-safety
error (or does not compile under Clang), 2 on a usage or setup error, 77 when
Clang is not installed (ctest's SKIP_RETURN_CODE). Needs the generated protobuf
headers, so run it after building. CLANGXX overrides the compiler.
"""

import argparse
import concurrent.futures
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

SKIP = 77

# Flags copied from the build's command: they decide what the code means.
# Everything else (GCC's warnings and optimisation flags, -o, -c) is dropped.
JOINED_PREFIXES = ("-I", "-D", "-U", "-std=")
SEPARATE_FLAGS = ("-I", "-D", "-U", "-isystem", "-iquote", "-include", "-idirafter")


def clang_flags(arguments):
    """The include, define and standard flags of one compile command."""
    out = []
    i = 0
    while i < len(arguments):
        a = arguments[i]
        if a in SEPARATE_FLAGS and i + 1 < len(arguments):
            out += [a, arguments[i + 1]]
            i += 2
            continue
        if a.startswith(JOINED_PREFIXES) or a.startswith(("-isystem", "-iquote")):
            out.append(a)
        i += 1
    return out


# What can give the analysis something to check: absl's mutexes and lock guards,
# and the thread-safety annotation macros (absl/base/thread_annotations.h).
LOCK_CODE = re.compile(r"Mutex|SpinLock|GUARDED_BY|LOCKS?_|LOCKABLE|CAPABILITY|ACQUIRE|RELEASE|"
                       r"ASSERT_(EXCLUSIVE|SHARED)|THREAD_ANNOTATION|thread_annotations")
INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


def has_lock_code(file, source_dir, memo):
    """Whether `file` or a psflow header it includes (transitively) has lock code.

    Quoted includes are looked up next to the including file and at the source
    root (psflow includes are root-relative); others (absl, generated protobuf
    headers) are not followed: their locks are behind their own interfaces.
    """
    if file in memo:
        return memo[file]
    memo[file] = False  # include cycles
    try:
        with open(file, errors="replace") as f:
            text = f.read()
    except OSError:
        return False
    found = bool(LOCK_CODE.search(text))
    for inc in INCLUDE.findall(text) if not found else []:
        for base in (os.path.dirname(file), source_dir):
            path = os.path.realpath(os.path.join(base, inc))
            if path.startswith(source_dir + os.sep) and os.path.isfile(path):
                found = has_lock_code(path, source_dir, memo)
                break
        if found:
            break
    memo[file] = found
    return found


def load_commands(build_dir, source_dir):
    path = os.path.join(build_dir, "compile_commands.json")
    try:
        with open(path) as f:
            entries = json.load(f)
    except FileNotFoundError:
        sys.exit(f"check-thread-safety: no {path}; configure with "
                 "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON (a Makefile or Ninja generator)")
    build_abs = os.path.realpath(build_dir) + os.sep
    commands = {}
    for e in entries:
        file = os.path.realpath(os.path.join(e.get("directory", ""), e["file"]))
        # psflow's own C++ only: not the protoc output under the build directory
        # (nor a build directory inside the source tree), not CUDA.
        if not file.startswith(source_dir + os.sep) or file.startswith(build_abs):
            continue
        if not file.endswith(".cc"):
            continue
        args = e.get("arguments") or shlex.split(e["command"])
        commands[file] = (e.get("directory", build_dir), clang_flags(args[1:]))
    return commands


def check(clangxx, file, directory, flags):
    cmd = [clangxx, "-fsyntax-only", "-Wthread-safety", "-Werror=thread-safety",
           "-Wno-unknown-warning-option", *flags, file]
    if not any(f.startswith("-std=") for f in flags):
        cmd.insert(1, "-std=c++20")
    p = subprocess.run(cmd, cwd=directory, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True)
    return file, p.returncode, p.stdout


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("build_dir")
    parser.add_argument("files", nargs="*", help="only these sources (paths or suffixes)")
    parser.add_argument("--all", action="store_true",
                        help="compile every file, not only those with lock code")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1,
                        help="files checked at once (default: the number of cores)")
    args = parser.parse_intermixed_args()
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")

    clangxx = os.environ.get("CLANGXX", "clang++-14")
    if shutil.which(clangxx) is None:
        print(f"check-thread-safety: SKIPPED: {clangxx} not found "
              "(apt-get install clang-14, or set CLANGXX)")
        return SKIP

    source_dir = os.path.realpath(os.path.join(os.path.dirname(__file__), ".."))
    commands = load_commands(args.build_dir, source_dir)
    if args.files:
        wanted = [os.path.normpath(f) for f in args.files]
        commands = {f: c for f, c in commands.items()
                    if any(f == os.path.realpath(w) or f.endswith(os.sep + w) for w in wanted)}
    if not commands:
        print("check-thread-safety: no psflow .cc files in the compile commands", file=sys.stderr)
        return 2
    total = len(commands)
    if not args.all:
        memo = {}
        commands = {f: c for f, c in commands.items() if has_lock_code(f, source_dir, memo)}

    start = time.monotonic()
    failed = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(check, clangxx, f, d, fl) for f, (d, fl) in sorted(commands.items())]
        for future in futures:  # in file order, so the log reads the same every run
            file, code, output = future.result()
            if code != 0:
                failed.append(os.path.relpath(file, source_dir))
                sys.stdout.write(output)
    elapsed = time.monotonic() - start

    n = len(commands)
    skipped = f"; {total - n} without lock code not compiled" if total > n else ""
    if failed:
        print(f"check-thread-safety: {len(failed)} of {n} files fail{skipped} "
              f"({elapsed:.0f}s): {' '.join(failed)}")
        return 1
    print(f"check-thread-safety: {n} files clean under {clangxx} -Wthread-safety{skipped} "
          f"({elapsed:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
