#!/usr/bin/env python3
"""Holds psflow's function-length budget: no function over 100 lines.

  scripts/check-function-length.py [--max N] [--report M] [--exceptions FILE]

Scans every tracked C++/CUDA source (`git ls-files '*.cc' '*.h' '*.cu' '*.cuh'`,
from the repository root; tests/ and bench/ included, reported apart as test
code) for function bodies and measures each one.

How a function is found: comments, string and character literals (raw strings
R"d(...)d" too) and preprocessor lines are blanked out, then braces are matched.
A `{` at namespace or class scope (never inside another function body) opens a
function body when the declaration before it has a parameter list `name(...)`
with no `=` before it (so `auto f = [](...) {...};` is a variable), whatever
follows the list: const, noexcept, override, final, `-> type`, ABSL_*(...)
annotations, a constructor's member-initializer list `: a_(x), b_{y}`. That
covers free functions, methods defined in or out of their class, operators and
gtest's TEST(...)/TEST_F(...)/TEST_P(...) bodies (named Suite.Name). Everything
inside a body, lambdas and local classes included, counts toward the function
that holds it; if/for/while/switch/catch blocks only occur inside bodies.
Names are qualified-ish: enclosing classes and the declarator's own
qualification (`Trainer::RunLanes`), no namespaces, no template arguments.

How lines are counted: from the line of the signature's name (the line holding
`Trainer::RunLanes(` or `TEST(`, not a return type or template<> line above it)
through the line of the closing brace, inclusive; blank and comment lines are
included. clang-tidy's readability-function-size LineThreshold likewise counts
every line, blank and comment ones too, but only from the body's `{` to its `}`
(their difference), so for a one-line signature with `{` on it this count is
that one plus one.

Budget: a function over --max lines (default 100) fails the check unless FILE
(--exceptions, default scripts/function-length-exceptions.txt) lists it, one
`path:Name max_lines` a line (`#` starts a comment). The list only shrinks: the
check fails, with one line per problem, when a function over the budget is not
listed, when a listed one is longer than its recorded max (it grew), and when
an entry matches no function over the budget (it is stale: delete it). Where
one file has two functions of one name (overloads), the entry covers both.

--report M (default 60) is informative: the summary line gives how many
functions are over M lines; passing --report also lists them.

Exit status: 0 when the budget holds, 1 when it does not, 2 on a usage or setup
error. Output on success is one summary line, e.g.
  function-length: 0 over 100 lines (3 excepted), 41 over 60
"""

import argparse
import os
import re
import subprocess
import sys

SOURCE_PATTERNS = ("*.cc", "*.h", "*.cu", "*.cuh")
TEST_DIRS = ("tests/", "bench/")
DEFAULT_EXCEPTIONS = "scripts/function-length-exceptions.txt"

# Identifiers that may stand before a parenthesis in a declaration without it
# being the function's parameter list.
NOT_A_NAME = {
    "if", "for", "while", "switch", "catch", "return", "sizeof", "alignof",
    "alignas", "decltype", "noexcept", "static_assert", "typeid", "throw", "new",
    "delete", "co_await", "co_return", "co_yield", "requires", "template",
    "typename", "explicit", "__attribute__", "__declspec", "__launch_bounds__",
    "__align__", "asm", "__asm__", "_Pragma", "__pragma", "do", "else", "case",
}
CLASS_KEYS = ("class", "struct", "union")
GTEST_MACROS = ("TEST", "TEST_F", "TEST_P", "TYPED_TEST", "TYPED_TEST_P", "FRIEND_TEST")
RAW_PREFIXES = ("R", "u8R", "uR", "UR", "LR")
ENCODING_PREFIXES = ("u8", "u", "U", "L")

IDENT_START = re.compile(r"[A-Za-z_$]")
IDENT = re.compile(r"[A-Za-z0-9_$]*")
# A pp-number: digits, letters, dots, digit separators and exponent signs.
NUMBER = re.compile(r"\.?[0-9](?:[eEpP][+-]|'[0-9A-Za-z]|[0-9A-Za-z_.])*")
PUNCT2 = ("::", "->")


class Function:
    """One function body: where it is and how long it is."""

    def __init__(self, path, name, start, end):
        self.path = path
        self.name = name
        self.start = start  # line of the name
        self.end = end  # line of the closing brace

    @property
    def lines(self):
        return self.end - self.start + 1

    @property
    def key(self):
        return f"{self.path}:{self.name}"

    @property
    def is_test(self):
        return self.path.startswith(TEST_DIRS)

    def __repr__(self):
        return f"Function({self.key} {self.start}-{self.end})"


class ParseError(Exception):
    pass


def tokenize(text):
    """Returns [(token, line)] for `text` with comments, literals and
    preprocessor lines dropped. String literals become the token '"' and
    character literals "'" so that `extern "C"` still reads as two tokens."""
    tokens = []
    i, n, line = 0, len(text), 1
    line_start = True  # nothing but blanks (and comments) since the last newline

    def skip_block_comment(j):
        end = text.find("*/", j + 2)
        if end < 0:
            raise ParseError(f"line {line}: unterminated comment")
        return end + 2

    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
            line_start = True
            i += 1
            continue
        if c in " \t\r\f\v":
            i += 1
            continue
        if c == "\\" and text.startswith("\n", i + 1):  # a stray line splice
            i += 1
            continue
        if text.startswith("//", i):
            end = text.find("\n", i)
            i = n if end < 0 else end
            continue
        if text.startswith("/*", i):
            end = skip_block_comment(i)
            line += text.count("\n", i, end)
            i = end
            continue
        if c == "#" and line_start:
            # A preprocessor directive, to its last unspliced newline; comments
            # in it are skipped so that a /* ... */ spanning lines ends it right.
            while i < n and text[i] != "\n":
                if text.startswith("/*", i):
                    end = skip_block_comment(i)
                    line += text.count("\n", i, end)
                    i = end
                elif text.startswith("//", i):
                    end = text.find("\n", i)
                    i = n if end < 0 else end
                elif text[i] == "\\" and text.startswith("\n", i + 1):
                    line += 1
                    i += 2
                else:
                    i += 1
            continue
        line_start = False
        if IDENT_START.match(c):
            m = IDENT.match(text, i + 1)
            word = text[i:m.end()]
            j = m.end()
            if j < n and text[j] == '"' and word in RAW_PREFIXES:
                # Raw string: R"delim( ... )delim"
                open_paren = text.find("(", j + 1)
                if open_paren < 0:
                    raise ParseError(f"line {line}: bad raw string")
                delim = text[j + 1:open_paren]
                close = text.find(")" + delim + '"', open_paren + 1)
                if close < 0:
                    raise ParseError(f"line {line}: unterminated raw string")
                end = close + len(delim) + 2
                tokens.append(('"', line))
                line += text.count("\n", i, end)
                i = end
                continue
            if j < n and text[j] in "\"'" and word in ENCODING_PREFIXES:
                i = j  # u8"..." or L'x': the literal follows
                continue
            tokens.append((word, line))
            i = j
            continue
        if c.isdigit() or (c == "." and i + 1 < n and text[i + 1].isdigit()):
            m = NUMBER.match(text, i)
            tokens.append(("0", line))
            i = m.end()
            continue
        if c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                if text[j] == "\\":
                    j += 1
                elif text[j] == "\n":
                    raise ParseError(f"line {line}: unterminated literal")
                j += 1
            tokens.append((c, line))
            i = j + 1
            # A user-defined literal's suffix ("x"_s) goes with the literal.
            m = IDENT.match(text, i)
            i = m.end()
            continue
        two = text[i:i + 2]
        if two in PUNCT2:
            tokens.append((two, line))
            i += 2
            continue
        tokens.append((c, line))
        i += 1
    return tokens


def match_brackets(tokens):
    """Maps the index of every (, [ and { to the index of its partner."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    stack, match = [], {}
    for k, (t, line) in enumerate(tokens):
        if t in pairs:
            stack.append(k)
        elif t in (")", "]", "}"):
            if not stack or pairs[tokens[stack[-1]][0]] != t:
                raise ParseError(f"line {line}: unmatched '{t}'")
            match[stack.pop()] = k
    if stack:
        k = stack[-1]
        raise ParseError(f"line {tokens[k][1]}: unmatched '{tokens[k][0]}'")
    return match


def is_ident(t):
    return bool(IDENT_START.match(t))


class Parser:
    def __init__(self, path, text):
        self.path = path
        self.tokens = tokenize(text)
        self.match = match_brackets(self.tokens)
        self.functions = []

    def tok(self, k):
        return self.tokens[k][0]

    def parse(self):
        self.scan(0, len(self.tokens), [])
        return self.functions

    def scan(self, start, end, classes):
        """Walks the declarations in tokens[start:end] at namespace or class
        scope. `head` holds the indices of the current declaration's tokens
        at this level; a bracket group stands in it as its opening index."""
        head = []
        k = start
        while k < end:
            t = self.tok(k)
            if t == ";":
                head = []
                k += 1
            elif t in ("public", "private", "protected") and k + 1 < end and self.tok(k + 1) == ":":
                head = []
                k += 2
            elif t in ("(", "["):
                head.append(k)
                k = self.match[k] + 1
            elif t == "{":
                close = self.match[k]
                kind, name, first = self.classify(head, k)
                if kind == "function":
                    qualified = "::".join(classes + [name]) if name else "::".join(classes)
                    self.functions.append(
                        Function(self.path, qualified, self.tokens[first][1], self.tokens[close][1]))
                    head = []
                elif kind == "namespace":
                    self.scan(k + 1, close, classes)
                    head = []
                elif kind == "class":
                    self.scan(k + 1, close, classes + [name] if name else classes)
                    head = []
                else:  # an initializer, an enum's body: part of the declaration
                    head.append(k)
                k = close + 1
            else:
                head.append(k)
                k += 1

    def skip_angles(self, head, p):
        """head[p] is '<': returns the position after its matching '>'."""
        depth = 0
        while p < len(head):
            t = self.tok(head[p])
            if t == "<":
                depth += 1
            elif t == ">":
                depth -= 1
                if depth == 0:
                    return p + 1
            p += 1
        return p

    def find_parameters(self, head):
        """Returns (position in head of the parameter list's '(', position of
        the name's first token, name) or None. Looks at the head's top level
        only (outside template brackets), left to right, and stops at '='."""
        angle = 0
        class_key_at = None
        p = 0
        while p < len(head):
            t = self.tok(head[p])
            if t == "operator" and angle == 0:
                # operator==, operator(), operator bool, operator new[] ...
                q = p + 1
                if q < len(head) and self.tok(head[q]) == "(" and self.match[head[q]] == head[q] + 1:
                    q += 1  # operator()
                while q < len(head) and self.tok(head[q]) != "(":
                    q += 1
                if q >= len(head):
                    return None
                words = []
                for r in range(p + 1, q):
                    words.append("()" if self.tok(head[r]) == "(" else self.tok(head[r]))
                name = "operator" + ("" if not words or not is_ident(words[0]) else " ") + "".join(words)
                first, qual = self.qualifier(head, p)
                return q, first, qual + name
            if t == "<":
                angle += 1
            elif t == ">":
                angle = max(0, angle - 1)
            elif angle == 0:
                if t == "=":
                    return None
                if t in CLASS_KEYS:
                    class_key_at = p
                elif t == "(" and p > 0:
                    prev = self.tok(head[p - 1])
                    before_template = None
                    if prev == ">":  # Foo<int>(...): an explicit specialization
                        before_template = self.template_start(head, p - 1)
                        if before_template is not None and before_template > 0:
                            prev = self.tok(head[before_template - 1])
                    if (is_ident(prev) and prev not in NOT_A_NAME and not prev.startswith("ABSL_")
                            and (class_key_at is None or p - 1 != class_key_at + 1)):
                        name_at = p - 1 if before_template is None else before_template - 1
                        first, qual = self.qualifier(head, name_at)
                        name = prev
                        if prev in GTEST_MACROS:
                            args = [self.tok(a) for a in range(head[p] + 1, self.match[head[p]])]
                            parts = "".join(args).split(",")
                            name = ".".join(x for x in parts if x)
                        elif name_at > 0 and self.tok(head[name_at - 1]) == "~":
                            name = "~" + prev
                            first, qual = self.qualifier(head, name_at - 1)
                        return p, first, qual + name
            p += 1
        return None

    def template_start(self, head, p):
        """head[p] is '>': returns the position of its matching '<'."""
        depth = 0
        while p >= 0:
            t = self.tok(head[p])
            if t == ">":
                depth += 1
            elif t == "<":
                depth -= 1
                if depth == 0:
                    return p
            p -= 1
        return None

    def qualifier(self, head, p):
        """head[p] starts a name; returns (position of the qualified name's
        first token, 'A::B::' with template arguments dropped)."""
        parts = []
        while p >= 2 and self.tok(head[p - 1]) == "::":
            q = p - 2
            if self.tok(head[q]) == ">":
                q = self.template_start(head, q)
                if q is None or q == 0:
                    break
                q -= 1
            if not is_ident(self.tok(head[q])):
                break
            parts.insert(0, self.tok(head[q]))
            p = q
        if p >= 1 and self.tok(head[p - 1]) == "::" and not parts:
            p -= 1  # ::name
        first = p
        return first, "".join(x + "::" for x in parts)

    def classify(self, head, brace):
        """What the '{' at tokens[brace] opens, given the declaration before
        it: ('function', name, token index of the name), ('class', name, None),
        ('namespace', None, None) or ('other', None, None)."""
        if not head:
            return "other", None, None
        found = self.find_parameters(head)
        if found is not None:
            params, first, name = found
            # After a constructor's parameter list, a single ':' opens the
            # member initializers; there `name{...}` / `Base<T>{...}` is an
            # initializer and the body's '{' follows a ')' or a '}'.
            in_initializers = any(self.tok(h) == ":" for h in head[params + 1:])
            last = self.tok(head[-1])
            if in_initializers and (is_ident(last) or last == ">"):
                return "other", None, None
            return "function", name, head[first]
        words = [self.tok(h) for h in head]
        if "enum" in words:
            return "other", None, None
        if "namespace" in words or words[0] == "extern":
            return "namespace", None, None
        for p, w in enumerate(words):
            if w in CLASS_KEYS and "=" not in words[:p]:
                return "class", self.class_name(head, p), None
        return "other", None, None

    def class_name(self, head, p):
        """head[p] is the class key: the name is the last identifier before
        the base clause, outside template brackets and bracket groups."""
        name = None
        q = p + 1
        while q < len(head):
            t = self.tok(head[q])
            if t == ":":
                break
            if t == "<":
                q = self.skip_angles(head, q)
                continue
            if is_ident(t) and t != "final" and not t.startswith(("ABSL_", "__")) and t != "alignas":
                name = t
            q += 1
        return name


def parse(path, text):
    """Every function body in `text` (the contents of `path`), in order."""
    return Parser(path, text).parse()


def tracked_sources():
    out = subprocess.run(["git", "ls-files", "-z", "--", *SOURCE_PATTERNS],
                         check=True, capture_output=True, text=True).stdout
    return sorted(p for p in out.split("\0") if p)


def read_exceptions(path):
    """Returns ({key: max_lines}, [problem]) from the exceptions file."""
    entries, problems = {}, []
    if not os.path.exists(path):
        return entries, problems
    with open(path, encoding="utf-8") as f:
        for number, raw in enumerate(f, 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            fields = line.rsplit(None, 1)
            if len(fields) != 2 or not fields[1].isdigit() or ":" not in fields[0]:
                problems.append(f"{path}:{number}: expected 'path:Name max_lines', got '{line}'")
                continue
            key, limit = fields[0], int(fields[1])
            if key in entries:
                problems.append(f"{path}:{number}: {key} listed twice")
            entries[key] = limit
    return entries, problems


def check(functions, entries, budget):
    """Returns ([problem], [note], excepted functions) for the budget."""
    problems, notes, excepted = [], [], []
    over = [f for f in functions if f.lines > budget]
    for f in over:
        limit = entries.get(f.key)
        where = f"{f.path}:{f.start}: {f.name}"
        if limit is None:
            problems.append(f"{where} is {f.lines} lines, over the budget of {budget} "
                            f"(and not in the exceptions file); cut it")
        elif f.lines > limit:
            problems.append(f"{where} grew to {f.lines} lines (exceptions file allows {limit})")
        else:
            excepted.append(f)
            if f.lines < limit:
                notes.append(f"note: {where} is down to {f.lines} lines; "
                             f"lower its entry ({limit}) to {f.lines}")
    over_keys = {f.key for f in over}
    for key, limit in entries.items():
        if key not in over_keys:
            lengths = [f.lines for f in functions if f.key == key]
            now = f"now {max(lengths)} lines, within {budget}" if lengths else "no such function"
            problems.append(f"{key} {limit}: stale exception ({now}); delete the entry")
    return problems, notes, excepted


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="No function over --max lines, but those the exceptions file lists.")
    ap.add_argument("--max", type=int, default=100, help="the budget in lines (default 100)")
    ap.add_argument("--report", type=int, default=None, metavar="M",
                    help="list the functions over M lines (the summary counts those over 60 "
                         "without it); informative only")
    ap.add_argument("--exceptions", default=DEFAULT_EXCEPTIONS, metavar="FILE",
                    help=f"the functions still allowed over the budget (default {DEFAULT_EXCEPTIONS})")
    args = ap.parse_args(argv)
    report = 60 if args.report is None else args.report

    try:
        paths = tracked_sources()
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"function-length: cannot list the tracked sources (run from a git checkout): {e}",
              file=sys.stderr)
        return 2
    if not paths:
        print("function-length: no tracked sources found", file=sys.stderr)
        return 2

    functions, problems = [], []
    for path in paths:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                functions.extend(parse(path, f.read()))
        except ParseError as e:
            problems.append(f"{path}: cannot parse: {e}")
        except FileNotFoundError:
            pass  # deleted but not yet staged

    entries, entry_problems = read_exceptions(args.exceptions)
    budget_problems, notes, excepted = check(functions, entries, args.max)
    problems += entry_problems + budget_problems

    reported = sorted((f for f in functions if f.lines > report), key=lambda f: (-f.lines, f.key))
    if args.report is not None:
        for title, group in (("production", [f for f in reported if not f.is_test]),
                             ("tests/bench", [f for f in reported if f.is_test])):
            print(f"{title}: {len(group)} over {report} lines")
            for f in group:
                print(f"  {f.lines:4d}  {f.path}:{f.start}  {f.name}")
    for note in notes:
        print(note)
    sys.stdout.flush()
    for problem in problems:
        print(problem, file=sys.stderr)
    unexcepted = sum(1 for f in functions if f.lines > args.max) - len(excepted)
    tests_excepted = sum(1 for f in excepted if f.is_test)
    print(f"function-length: {unexcepted} over {args.max} lines ({len(excepted)} excepted: "
          f"{len(excepted) - tests_excepted} production, {tests_excepted} tests), "
          f"{len(reported)} over {report}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
