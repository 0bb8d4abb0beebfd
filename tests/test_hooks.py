"""load_hooks rules and messages (AGL v1 parity) and the buffering TraceWriter."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from agl_lab.hooks import BufferedTraceWriter, RolloutHooks, TraceWriter, load_hooks
from agl_lab.protocol import RolloutCreate


def _write(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def test_loads_the_one_subclass_and_instantiates_it(tmp_path):
    path = _write(
        tmp_path,
        "hooks.py",
        """
        from agl_lab.hooks import RolloutHooks

        class AddTag(RolloutHooks):
            def on_enqueue(self, request):
                request.input = {**request.input, "tag": "x"}
                return request
    """,
    )
    hooks = load_hooks(path)
    assert type(hooks).__name__ == "AddTag" and isinstance(hooks, RolloutHooks)
    assert type(hooks).__module__ == "_agl_hooks"
    assert hooks.on_enqueue(RolloutCreate(input={"q": 1})).input == {"q": 1, "tag": "x"}


def test_missing_file_names_the_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as err:
        load_hooks("nope/hooks.py")
    assert str(err.value) == f"Hooks module not found: {tmp_path.resolve() / 'nope' / 'hooks.py'}"


def test_no_subclass(tmp_path):
    path = _write(
        tmp_path,
        "empty.py",
        """
        from agl_lab.hooks import RolloutHooks  # the base class itself does not count

        class NotAHook:
            pass
    """,
    )
    with pytest.raises(ValueError) as err:
        load_hooks(path)
    assert str(err.value) == f"No RolloutHooks subclass found in {path.resolve()}"


def test_several_subclasses_are_listed(tmp_path):
    path = _write(
        tmp_path,
        "two.py",
        """
        from agl_lab.hooks import RolloutHooks

        class First(RolloutHooks):
            pass

        class Second(First):
            pass
    """,
    )
    with pytest.raises(ValueError) as err:
        load_hooks(path)
    assert str(err.value) == f"Multiple RolloutHooks subclasses found in {path.resolve()}: ['First', 'Second']"


def test_imported_subclass_counts(tmp_path, monkeypatch):
    _write(
        tmp_path,
        "shared_hooks.py",
        """
        from agl_lab.hooks import RolloutHooks

        class Shared(RolloutHooks):
            pass
    """,
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    path = _write(tmp_path, "uses_import.py", "from shared_hooks import Shared\n")
    assert type(load_hooks(path)).__name__ == "Shared"


def test_base_hooks_are_no_ops():
    hooks = RolloutHooks()
    request = RolloutCreate(input={"q": 1})
    assert hooks.on_enqueue(request) is request
    assert hooks.on_startup() is None


def test_buffered_writer_flushes_in_order():
    class Sink:
        def __init__(self):
            self.written = []

        def add_event(self, rollout_id, attempt_id, event_type, data):
            self.written.append((rollout_id, attempt_id, event_type, data))

    writer, sink = BufferedTraceWriter(), Sink()
    assert isinstance(writer, TraceWriter) and isinstance(sink, TraceWriter)
    writer.add_event("r", "0", "reward", {"value": 1.0})
    writer.add_event("r", "0", "note", {})
    assert sink.written == []  # nothing lands before the hook has returned
    assert writer.flush(sink) == 2
    assert sink.written == [("r", "0", "reward", {"value": 1.0}), ("r", "0", "note", {})]
    assert writer.flush(sink) == 0
