#!/usr/bin/env python3
"""Tests scripts/check-function-length.py: which bodies its parser takes for
functions, the names and lengths it gives them, and the budget's rules."""

import importlib.util
import os
import textwrap
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location(
    "check_function_length", os.path.join(ROOT, "scripts", "check-function-length.py"))
cfl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cfl)


def functions(source, path="x.cc"):
    """[(name, start line, lines)] for `source`, dedented, its first line 1."""
    text = textwrap.dedent(source).lstrip("\n")
    return [(f.name, f.start, f.lines) for f in cfl.parse(path, text)]


class ParserTest(unittest.TestCase):

    def test_constructor_with_member_initializers(self):
        self.assertEqual(
            functions("""
                class Foo : public Base {
                 public:
                  explicit Foo(int a, int b)
                      : Base(a),
                        a_(a),
                        b_{b},
                        c_{[this] { return a_; }()},
                        d_(std::vector<int>{1, 2}) {
                    Init();
                  }
                  int Get() const override { return a_; }
                  ~Foo() = default;

                 private:
                  int a_ = 0;
                  int b_{0};
                  std::atomic<bool> c_{false};
                };
                Foo::Foo(int a) : Foo(a, a) {}
                Foo::~Foo() {
                }
            """),
            [("Foo::Foo", 3, 8), ("Foo::Get", 11, 1), ("Foo::Foo", 19, 1), ("Foo::~Foo", 20, 2)])

    def test_lambdas_and_literals_with_braces_stay_in_their_function(self):
        self.assertEqual(
            functions('''
                // A comment with a brace {
                #define OPEN {
                #define MULTI(x) \\
                  { x }
                int Run(int x) {
                  auto f = [&](int y) {
                    if (y) { return y; }
                    return 0;
                  };
                  const char* spec = R"spec(layer { } }}} {
                    name: "x" })spec";
                  const char* s = "}\\" {";  /* } */
                  char c = '{', d = '\\'';
                  int64_t big = 1'000'000;
                  return f(x) + c + '}';
                }
                void After() {}
            '''),
            [("Run", 5, 12), ("After", 17, 1)])

    def test_test_bodies_are_functions(self):
        self.assertEqual(
            functions("""
                namespace psflow {
                namespace {

                TEST(ShardTest, Applies) {
                  EXPECT_EQ(1, 1);
                }

                TEST_F(PsServiceTest, InitPullPushPull) {
                  for (int i = 0; i < 3; ++i) {
                    Push(i);
                  }
                }

                TEST_P(WireTest, RoundTrips) { EXPECT_TRUE(true); }
                INSTANTIATE_TEST_SUITE_P(Dtypes, WireTest, ::testing::Values(1, 2),
                                         [](const auto& info) { return info.param; });

                }  // namespace
                }  // namespace psflow
            """, path="tests/ps/x_test.cc"),
            [("ShardTest.Applies", 4, 3), ("PsServiceTest.InitPullPushPull", 8, 5),
             ("WireTest.RoundTrips", 14, 1)])

    def test_control_blocks_are_part_of_the_function(self):
        self.assertEqual(
            functions("""
                absl::Status Trainer::Step(int n) ABSL_LOCKS_EXCLUDED(mu_) {
                  if (n > 0) {
                    return absl::OkStatus();
                  } else if (n < 0) {
                  }
                  while (true) {
                    switch (n) {
                      case 1: {
                        break;
                      }
                    }
                  }
                  try {
                  } catch (...) {
                  }
                  struct Local {
                    void Method() {}
                  };
                  return absl::OkStatus();
                }
            """),
            [("Trainer::Step", 1, 20)])

    def test_templates_operators_and_trailing_returns(self):
        self.assertEqual(
            functions("""
                template <typename T>
                std::vector<T>
                Twice(const std::vector<T>& v) {
                  return v;
                }
                template <>
                int Holder<int>::Get() const noexcept {
                  return 1;
                }
                std::function<void(int)> MakeCallback() { return nullptr; }
                auto Sum(int a, int b) -> decltype(a + b) { return a + b; }
                struct Less {
                  bool operator()(int a, int b) const { return a < b; }
                  bool operator<(const Less&) const { return false; }
                  explicit operator bool() const { return true; }
                  template <typename U>
                  static Less Make(U) { return {}; }
                };
                bool operator==(const Less&, const Less&) { return true; }
            """),
            [("Twice", 3, 3), ("Holder::Get", 7, 3), ("MakeCallback", 10, 1), ("Sum", 11, 1),
             ("Less::operator()", 13, 1), ("Less::operator<", 14, 1),
             ("Less::operator bool", 15, 1), ("Less::Make", 17, 1), ("operator==", 19, 1)])

    def test_variables_types_and_declarations_are_not_functions(self):
        self.assertEqual(
            functions("""
                namespace psflow {
                const auto kCheck = [](int x) {
                  return x > 0;
                };
                const std::map<std::string, int> kNames = {
                    {"a", 1},
                    {"b", 2},
                };
                enum class Kind : int { kA, kB };
                struct alignas(64) Padded { int x; };
                extern "C" {
                int CFunction(int x);
                }
                class Widget;
                void Declared(int x);
                int Defined() { return Kind::kA == Kind::kB; }
                }  // namespace psflow
            """),
            [("Defined", 16, 1)])

    def test_nested_classes_qualify_their_methods(self):
        self.assertEqual(
            functions("""
                class Outer {
                  struct Inner {
                    int Value() const { return 1; }
                  };
                  class ABSL_LOCKABLE Lock final : public Base<int> {
                    void Acquire() ABSL_EXCLUSIVE_LOCK_FUNCTION() {}
                  };
                };
            """, path="x.h"),
            [("Outer::Inner::Value", 3, 1), ("Outer::Lock::Acquire", 6, 1)])

    def test_unbalanced_braces_are_an_error(self):
        with self.assertRaises(cfl.ParseError):
            cfl.parse("x.cc", "void F() {\n")


class BudgetTest(unittest.TestCase):

    def fn(self, name, lines, path="a.cc"):
        return cfl.Function(path, name, 10, 10 + lines - 1)

    def test_rules(self):
        fs = [self.fn("Small", 50), self.fn("Listed", 120), self.fn("Grew", 130),
              self.fn("New", 101), self.fn("Shrank", 110), self.fn("Cut", 90),
              self.fn("AtBudget", 100)]
        entries = {"a.cc:Listed": 120, "a.cc:Grew": 125, "a.cc:Shrank": 115, "a.cc:Cut": 140,
                   "a.cc:Gone": 200}
        problems, notes, excepted = cfl.check(fs, entries, 100)
        self.assertEqual([f.name for f in excepted], ["Listed", "Shrank"])
        self.assertEqual(len(problems), 4, problems)
        self.assertIn("Grew grew to 130", problems[0])
        self.assertIn("New is 101 lines", problems[1])
        self.assertIn("a.cc:Cut 140: stale", problems[2])
        self.assertIn("a.cc:Gone 200: stale", problems[3])
        self.assertEqual(len(notes), 1)
        self.assertIn("Shrank is down to 110", notes[0])

    def test_test_code_is_told_apart(self):
        self.assertTrue(self.fn("T", 1, path="tests/ps/shard_test.cc").is_test)
        self.assertTrue(self.fn("main", 1, path="bench/ps_wire.cc").is_test)
        self.assertFalse(self.fn("main", 1, path="worker/main.cc").is_test)


if __name__ == "__main__":
    unittest.main()
