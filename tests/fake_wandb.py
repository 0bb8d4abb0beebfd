"""A fake W&B module and run: what the metrics logger and the Trainer send to W&B, kept to assert on.

    monkeypatch.setitem(sys.modules, "wandb", FakeWandb)    # `wandb.Table`, `wandb.Artifact`
    run = FakeRun(); logger._wandb_run = run
    run.tables("training/rollout_trajectories")              # [(step, FakeTable), ...]

tests/test_logger.py checks that the real `wandb.Table` / `wandb.Artifact` accept what is passed.
"""

from __future__ import annotations


class FakeTable:
    def __init__(self, columns, data):
        self.columns, self.data = columns, data


class FakeArtifact:
    def __init__(self, name, type, metadata):
        self.name, self.type, self.metadata, self.files = name, type, metadata, {}

    def add_file(self, local_path, name):
        with open(local_path, "rb") as fh:
            self.files[name] = fh.read()


class FakeWandb:
    Table, Artifact = FakeTable, FakeArtifact


class FakeRun:
    id = "fake-run"

    def __init__(self):
        self.logged, self.artifacts, self.finished = [], [], False

    def log(self, data, step):
        self.logged.append((step, data))

    def log_artifact(self, artifact):
        self.artifacts.append(artifact)

    def finish(self):
        self.finished = True

    def tables(self, key):
        return [(step, d[key]) for step, d in self.logged if key in d]
