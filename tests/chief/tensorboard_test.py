"""The chief's event files, read by the real TensorBoard package.

Runs short jobs with psflow-launch, parses the chief's progress lines, and
checks that TensorBoard (from the venv scripts/test.sh makes) finds every
scalar at every logged step with the logged values, in files whose records
pass TensorBoard's CRC checks; then that a restarted chief adds a new file,
leaves the old one intact, and that TensorBoard's SessionLog START handling
drops exactly the points that the restart trains again; and that an
evaluator's results, logged by the chief as eval lines, are in the eval
directory at the evaluated steps.

Usage: tensorboard_test.py --python=<venv>/bin/python --bin_dir=<build>/bin
Run by some python3, it re-runs itself with the venv's python; without that
venv or without tensorboard in it, it fails with one line saying so.
"""

import argparse
import glob
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

ARGS = None

TAGS = [
    "loss",
    "accuracy",
    "examples_per_sec",
    "learning_rate",
    "step_ms/pull",
    "step_ms/compute",
    "step_ms/push",
    "step_ms/wait",
    "live_workers",
    "live_ps",
]

LINE = re.compile(
    r"^\[chief\] .*? step (?P<step>\d+)/(?P<total>\d+) epoch [\d.]+ loss (?P<loss>\S+) "
    r"acc (?P<accuracy>\S+) lr (?P<learning_rate>\S+) \| (?P<examples_per_sec>\d+) ex/s \| "
    r"step [\d.]+ ms \(pull (?P<pull>\S+) compute (?P<compute>\S+) push (?P<push>\S+) "
    r"wait (?P<wait>\S+)\) \| workers (?P<live_workers>\d+)/\d+ ps (?P<live_ps>\d+)/\d+ \|"
)

LOG_EVERY = 50

EVAL_LINE = re.compile(
    r"^\[chief\] .*? eval: step (?P<step>\d+)/\d+ loss (?P<loss>\S+) acc (?P<accuracy>\S+) \|")


def decimals(text):
    return len(text.split(".")[1]) if "." in text else 0


def tolerance(tag, printed):
    """How far a float32 event value may be from the log's printed text."""
    value = float(printed)
    f32 = 1e-6 * abs(value) + 1e-9  # float32 keeps about 7 digits
    if tag == "learning_rate":  # %.4g: 4 significant digits
        return 5e-4 * abs(value) + f32
    if tag in ("live_workers", "live_ps"):
        return 0
    return 0.5 * 10 ** -decimals(printed) + f32


def logged(line_match):
    """tag -> printed text of one progress line."""
    g = line_match.groupdict()
    return {
        "loss": g["loss"],
        "accuracy": g["accuracy"],
        "examples_per_sec": g["examples_per_sec"],
        "learning_rate": g["learning_rate"],
        "step_ms/pull": g["pull"],
        "step_ms/compute": g["compute"],
        "step_ms/push": g["push"],
        "step_ms/wait": g["wait"],
        "live_workers": g["live_workers"],
        "live_ps": g["live_ps"],
    }


class TensorBoardTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="psflow_tensorboard_")
        self.model_dir = os.path.join(self.dir, "model")
        self.train_dir = os.path.join(self.model_dir, "train")

    def tearDown(self):
        if getattr(self, "passed", False):
            shutil.rmtree(self.dir, ignore_errors=True)
        else:
            print("kept", self.dir)

    def train(self, steps, extra=()):
        """Runs a job to `steps`; returns (chief output, {step: {tag: text}}, start, end)."""
        # As the C++ process tests: the caller's cluster environment changes nothing.
        env = {k: v for k, v in os.environ.items()
               if k not in ("TF_CONFIG", "CLUSTER_CONFIG", "POD_NAME")}
        cmd = [
            os.path.join(ARGS.bin_dir, "psflow-launch"), "--ps=1", "--workers=2", *extra, "--",
            "--model=mlp", f"--train_steps={steps}", f"--log_every_steps={LOG_EVERY}",
            "--learning_rate=0.05", "--lr_decay=exponential", "--lr_decay_steps=100",
            "--lr_decay_rate=0.5", "--checkpoint_every_steps=100",
            f"--model_dir={self.model_dir}",
        ]
        if extra:  # an evaluator: every 100 steps
            cmd.append("--eval_every_steps=100")
        start = time.time()
        run = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, timeout=120)
        end = time.time()
        self.assertEqual(run.returncode, 0, f"{' '.join(cmd)}\n{run.stdout}")
        lines = {}
        for text in run.stdout.splitlines():
            m = LINE.match(text)
            if m:
                self.assertEqual(int(m["total"]), steps, text)
                lines[int(m["step"])] = logged(m)
        self.assertTrue(lines, f"no progress lines in\n{run.stdout}")
        return run.stdout, lines, start, end

    def files(self):
        return sorted(glob.glob(os.path.join(self.train_dir, "*")))

    def read_records(self, path):
        """Every record of `path`, through TensorBoard's record reader, which
        checks both CRCs of each record and raises DataLossError on a mismatch."""
        from tensorboard.compat.tensorflow_stub import errors, pywrap_tensorflow

        reader = pywrap_tensorflow.PyRecordReader_New(path, 0, None, None)
        records = []
        while True:
            try:
                reader.GetNext()
            except errors.OutOfRangeError:
                return records
            records.append(reader.record())

    def load(self, path):
        """The events of one file, as TensorBoard's EventFileLoader yields them,
        after checking every record with read_records."""
        from tensorboard.backend.event_processing import event_file_loader

        raw = self.read_records(path)
        events = list(event_file_loader.EventFileLoader(path).Load())
        # The loader stops quietly at a bad record: it must have read them all.
        self.assertEqual(len(events), len(raw), path)
        self.assertGreaterEqual(len(events), 2, path)
        self.assertEqual(events[0].file_version, "brain.Event:2", path)
        return events

    def check_file(self, path, start_step, lines, wall_from, wall_to):
        """`path` holds: the version, a START at start_step, then one event per
        progress line (in order) with every tag at the logged value."""
        events = self.load(path)
        self.assertTrue(events[1].HasField("session_log"), path)
        self.assertEqual(events[1].session_log.status, 1, path)  # START
        self.assertEqual(events[1].step, start_step, path)
        scalars = events[2:]
        self.assertEqual([e.step for e in scalars], sorted(lines), path)
        for e in scalars:
            self.assertGreaterEqual(e.wall_time, wall_from - 1, path)
            self.assertLessEqual(e.wall_time, wall_to + 1, path)
            # EventFileLoader migrates simple_value into a scalar tensor.
            values = {v.tag: v.tensor.float_val[0] if v.HasField("tensor") else v.simple_value
                      for v in e.summary.value}
            self.assertEqual(sorted(values), sorted(TAGS), f"{path} step {e.step}")
            for tag, printed in lines[e.step].items():
                self.assertLessEqual(
                    abs(values[tag] - float(printed)), tolerance(tag, printed),
                    f"{path} step {e.step} {tag}: {values[tag]} vs the log's {printed}")

    def check_accumulated(self, expected):
        """TensorBoard's view of the whole train directory (restarts applied):
        every tag at exactly the steps of `expected` ({step: {tag: text}})."""
        self.check_scalars(self.train_dir, TAGS, expected)

    def check_scalars(self, directory, tags, expected, what=""):
        """TensorBoard's view of `directory`: exactly `tags`, each at exactly the
        steps of `expected` ({step: {tag: text}}) with the printed values."""
        from tensorboard.backend.event_processing import event_accumulator as ea

        acc = ea.EventAccumulator(directory, size_guidance={ea.SCALARS: 0})
        acc.Reload()
        self.assertEqual(sorted(acc.Tags()["scalars"]), sorted(tags))
        for tag in tags:
            points = acc.Scalars(tag)
            self.assertEqual([p.step for p in points], sorted(expected), tag)
            for p in points:
                printed = expected[p.step][tag]
                self.assertLessEqual(abs(p.value - float(printed)), tolerance(tag, printed),
                                     f"{what}step {p.step} {tag}: {p.value} vs the log's {printed}")

    def test_eval_event_files(self):
        """An evaluator's results: loss and accuracy in <model_dir>/eval at the
        steps of the chief's eval lines, with the logged values, beside the
        training curves in <model_dir>/train."""
        out, lines, _, _ = self.train(300, extra=("--evaluators=1",))
        evals = {}
        for text in out.splitlines():
            m = EVAL_LINE.match(text)
            if m:
                evals[int(m["step"])] = {"loss": m["loss"], "accuracy": m["accuracy"]}
        self.assertIn(300, evals, out)
        self.check_accumulated(lines)
        self.check_scalars(os.path.join(self.model_dir, "eval"), ("loss", "accuracy"), evals,
                           "eval ")
        self.passed = True

    def test_event_files(self):
        # 1. A job of 200 steps: one file, a line every 50 steps.
        out1, lines1, start, end = self.train(200)
        self.assertEqual(sorted(lines1), [50, 100, 150, 200], out1)
        files = self.files()
        self.assertEqual(len(files), 1, files)
        first = files[0]
        self.assertRegex(os.path.basename(first), r"^events\.out\.tfevents\.\d+\.[^/]+\.\d+$")
        self.check_file(first, 1, lines1, start, end)
        self.check_accumulated(lines1)
        # The learning rate decays: the values are not one constant.
        self.assertGreater(len({lines1[s]["learning_rate"] for s in lines1}), 2)
        with open(first, "rb") as f:
            first_bytes = f.read()

        # A flipped byte in the last record is caught by the reader used above.
        bad = os.path.join(self.dir, "corrupt")
        with open(bad, "wb") as f:
            f.write(first_bytes[:-6] + bytes([first_bytes[-6] ^ 0x01]) + first_bytes[-5:])
        from tensorboard.compat.tensorflow_stub import errors
        with self.assertRaises(errors.DataLossError):
            self.read_records(bad)

        # 2. Again with more steps: the chief restores the checkpoint of step
        # 200 and writes a second file; the first is untouched.
        out2, lines2, start, end = self.train(300)
        self.assertIn("restoring from the checkpoint of step 200", out2)
        self.assertEqual(sorted(lines2), [250, 300], out2)
        files = self.files()
        self.assertEqual(len(files), 2, files)
        self.assertEqual(files[0], first)
        with open(first, "rb") as f:
            self.assertEqual(f.read(), first_bytes, "the old file changed")
        self.check_file(first, 1, lines1, 0, math.inf)
        self.check_file(files[1], 201, lines2, start, end)
        self.check_accumulated({**lines1, **lines2})

        # 3. Back to an older checkpoint, the first job's last (every newer
        # one removed): the steps after it are trained again, and TensorBoard
        # drops the points read before at those steps for the new ones,
        # keeping the points up to the checkpoint. (The first job may have
        # checkpointed mid-way too, or not: the chief checkpoints at the
        # version it sees once a multiple of 100 is passed, and a fast job can
        # reach its end first. Its end's checkpoint is always there.)
        ckpts = glob.glob(os.path.join(self.model_dir, "checkpoints", "ckpt-*"))
        self.assertIn(os.path.join(self.model_dir, "checkpoints", "ckpt-200"), ckpts)
        restored = 200
        for path in ckpts:
            if int(path.rsplit("-", 1)[1]) > restored:
                shutil.rmtree(path)
        out3, lines3, start, end = self.train(300)
        self.assertIn(f"restoring from the checkpoint of step {restored}", out3)
        self.assertEqual(sorted(lines3),
                         [s for s in range(LOG_EVERY, 301, LOG_EVERY) if s > restored], out3)
        files = self.files()
        self.assertEqual(len(files), 3, files)
        self.check_file(files[2], restored + 1, lines3, start, end)
        self.check_accumulated({**{s: v for s, v in lines1.items() if s <= restored}, **lines3})
        self.passed = True

def main():
    global ARGS
    parser = argparse.ArgumentParser()
    parser.add_argument("--python", required=True, help="the venv's python, with tensorboard")
    parser.add_argument("--bin_dir", required=True, help="the build's bin directory")
    ARGS, rest = parser.parse_known_args()
    venv = os.path.dirname(os.path.dirname(ARGS.python))
    if os.path.realpath(sys.prefix) != os.path.realpath(venv):
        ok = os.access(ARGS.python, os.X_OK) and subprocess.run(
            [ARGS.python, "-c", "import tensorboard"], stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL).returncode == 0
        if not ok:
            print(f"FAILED: no venv with tensorboard at {venv}: run scripts/test.sh (it makes the "
                  "venv and pip-installs tensorboard), then this test again")
            sys.exit(1)
        os.execv(ARGS.python, [ARGS.python, os.path.abspath(__file__)] + sys.argv[1:])
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)


if __name__ == "__main__":
    main()
