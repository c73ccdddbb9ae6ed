"""The chat REPL (mlx_stream.repl, what `mlx-stream chat` runs): commands, stats, Ctrl-C,
the terminal's process group and the line history."""

from __future__ import annotations

import io
import os
import re
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mlx_stream import ChatSession
from mlx_stream.repl import parse_line, run_chat

ROOT = Path(__file__).resolve().parents[1]
STATS = re.compile(r"\[(\d+) tokens, [\d.]+ tok/s, tau [\d.]+, prompt (\d+) new \+ (\d+) cached tokens\]")


def scripted(*lines):
    """An input_fn that returns ``lines`` in turn, then raises EOFError; ``.asked`` counts calls."""
    it = iter(lines)

    def read(prompt):
        read.asked += 1
        try:
            item = next(it)
        except StopIteration:
            raise EOFError from None
        if isinstance(item, BaseException):
            raise item
        return item

    read.asked = 0
    return read


def chat(session, *lines):
    out, err = io.StringIO(), io.StringIO()
    read = scripted(*lines)
    run_chat(session, model_name="tiny", input_fn=read, out=out, err=err)
    return out.getvalue(), err.getvalue(), read


@pytest.fixture()
def session(tiny):
    model, tok = tiny
    return ChatSession(model, tok, max_tokens=5)


def test_banner_states_the_settings_and_eof_exits(session):
    out, err, read = chat(session)
    assert out.startswith(
        "mlx-stream chat: tiny (plain decoding).\nReplies up to 5 tokens, greedy "
        "(--max-tokens, --temp to change). /help for commands"
    )
    assert err == "" and read.asked == 1 and session.messages == []


def test_banner_says_when_answers_are_kept(session):
    from mlx_stream.datastore import DraftStore

    try:
        session.model.datastore = DraftStore(learn=True)
        out, _, _ = chat(session)
        assert "answers are kept to draft from: --no-learn to stop" in out.splitlines()[0]
        session.model.datastore = DraftStore(learn=False)
        out, _, _ = chat(session)
        assert out.startswith("mlx-stream chat: tiny (plain decoding).\n")
    finally:
        session.model.datastore = None


def test_help_lists_the_commands_and_sends_nothing(session):
    out, err, _ = chat(session, "/help", "  /HELP  ")
    for cmd in ("/help", "/reset", "/exit", "//text"):
        assert cmd in out
    assert out.count("Commands:") == 2
    assert session.messages == [] and session.cache.tokens == [] and err == ""


def test_unknown_commands_are_refused_and_not_sent(session):
    out, err, _ = chat(session, "/bogus", "/bogus with words", "/reset now")
    assert err.count("unknown command /bogus; /help lists the commands") == 2
    assert "/reset takes no arguments" in err
    assert "[conversation cleared]" not in out and "tokens," not in err
    assert session.messages == []


def test_double_slash_sends_a_message_that_starts_with_a_slash(session):
    _, err, _ = chat(session, "//x", "/usr/bin holds what?")
    assert [m["content"] for m in session.messages if m["role"] == "user"] == ["/x", "/usr/bin holds what?"]
    assert err.count("tokens,") == 2


@pytest.mark.parametrize(
    "line,parsed",
    [
        ("", ("empty", "")),
        ("  \t", ("empty", "")),
        ("hi /x", ("message", "hi /x")),
        ("//", ("message", "/")),
        ("  //reset  ", ("message", "/reset  ")),
        ("/ 3", ("message", "/ 3")),
        ("/2 is a fraction", ("message", "/2 is a fraction")),
        ("/quit", ("command", "/exit")),
        ("/Reset", ("command", "/reset")),
        ("/x-y", ("error", "unknown command /x-y; /help lists the commands")),
    ],
)
def test_parse_line(line, parsed):
    assert parse_line(line) == parsed


def test_stats_show_new_and_cached_prompt_tokens_and_reset_clears(session):
    out, err, _ = chat(session, "The quick brown fox", "heads, trees!", "/reset", "again")
    stats = [tuple(map(int, m)) for m in STATS.findall(err)]
    assert len(stats) == 3 and err.count("tokens,") == 3 and len(err.splitlines()) == 3
    (n1, new1, cached1), (n2, new2, cached2), (n3, new3, cached3) = stats
    assert cached1 == 0 and new1 > 0
    assert cached2 > 0 and new2 > 0  # the second turn reuses the first turn's transcript
    assert cached2 <= new1 + n1  # ... which is all the cache can hold
    assert cached3 == 0  # /reset cleared the cache
    assert "[conversation cleared]" in out
    assert [m["content"] for m in session.messages] == ["again", session.messages[1]["content"]]


def test_ctrl_c_at_the_prompt_exits_cleanly(session):
    out, err, read = chat(session, "hello", KeyboardInterrupt(), "never read")
    assert read.asked == 2 and out.endswith("\n") and err.count("tokens,") == 1
    assert len(session.messages) == 2


def test_exit_and_quit_stop_reading(session):
    for cmd in ("/exit", " /QUIT "):
        _, _, read = chat(session, cmd, "never read")
        assert read.asked == 1
    assert session.messages == []


def test_ctrl_c_in_a_reply_stops_it_and_the_session_goes_on(tiny):
    model, tok = tiny
    calls = {"n": 0}

    def interrupt(tokens, logits):  # Ctrl-C in the middle of the first reply's decoding
        calls["n"] += 1  # 1: the first token; 2, 3: two plain steps queued before it is shown
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return logits

    session = ChatSession(model, tok, max_tokens=5, logits_processors=[interrupt])
    out, err, _ = chat(session, "The quick brown fox", "heads, trees!")
    assert "\n[stopped]\n" in out
    stats = [tuple(map(int, m)) for m in STATS.findall(err)]
    assert len(stats) == 2 and stats[1][0] == 5  # the second reply runs to max_tokens
    assert stats[1][2] == 0  # the interrupted step may have left the cache half done: it was cleared
    assert [m["role"] for m in session.messages] == ["user", "assistant"] * 2


def test_a_value_error_is_printed_and_the_loop_goes_on(session):
    out, err, _ = chat(session, "fox " * 600, "hello")
    assert re.search(r"^error: .*context window", err, re.M)
    assert err.count("tokens,") == 1
    assert [m["content"] for m in session.messages][0] == "hello"


# --- the terminal: process group and history -------------------------------------------------

# the subprocesses load repl.py by itself (standard library only): importing the package takes seconds
_LOAD = (
    "import importlib.util as _u; "
    f"_s = _u.spec_from_file_location('repl', {str(ROOT / 'mlx_stream' / 'repl.py')!r}); "
    "repl = _u.module_from_spec(_s); _s.loader.exec_module(repl)\n"
)


def _python(code: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _LOAD + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        **kw,
    )


@pytest.mark.parametrize("stdin", [subprocess.DEVNULL, subprocess.PIPE])
def test_foreground_group_is_a_no_op_without_a_terminal(stdin):
    r = _python(
        """
        import os
        own_foreground_group = repl.own_foreground_group
        before = os.getpgrp()
        assert before != os.getpid()  # a child of pytest: in pytest's group, not its leader
        with own_foreground_group() as taken:
            assert not taken and os.getpgrp() == before
        assert os.getpgrp() == before
        print("ok")
    """,
        stdin=stdin,
    )
    assert r.returncode == 0 and r.stdout == "ok\n", r.stderr


_PARENT = """
import subprocess, sys
r = subprocess.run([sys.executable, "-c", sys.argv[1], sys.argv[2]])
print("PARENT-ALIVE", r.returncode, flush=True)
"""

_CHILD = (
    _LOAD
    + """
import contextlib, os, sys, time
cm = repl.own_foreground_group() if sys.argv[1] == "own" else contextlib.nullcontext(False)
with cm as taken:
    print("TAKEN", taken, os.tcgetpgrp(0) == os.getpgrp(), flush=True)
    try:
        time.sleep(30)
    except KeyboardInterrupt:
        print("CHILD-GOT-INT", flush=True)
print("RESTORED", os.tcgetpgrp(0) == os.getppid(), flush=True)
"""
)


def _in_a_terminal(mode: str) -> str:
    """Run a parent that waits for a child (as make waits for the chat) in a new
    pseudo-terminal, press Ctrl-C once the child is sleeping; return what the terminal showed."""
    import pty

    pid, fd = pty.fork()
    if pid == 0:  # the session leader: the parent python is its terminal's foreground group
        try:  # a fresh terminal's signal state, whatever the test process had (as a shell starts it)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execv(sys.executable, [sys.executable, "-c", _PARENT, _CHILD, mode])
        finally:
            os._exit(127)
    seen, deadline, pressed = b"", time.monotonic() + 60, False
    try:
        while time.monotonic() < deadline:
            if not pressed and re.search(rb"TAKEN \w+ \w+\r?\n", seen):
                time.sleep(0.3)  # the child is asleep
                os.write(fd, b"\x03")
                pressed = True
            if select.select([fd], [], [], 0.2)[0]:
                try:
                    chunk = os.read(fd, 4096)
                except OSError:  # EIO: the terminal's other side is closed
                    break
                if not chunk:
                    break
                seen += chunk
    finally:
        os.close(fd)
        os.waitpid(pid, 0)
    return seen.decode(errors="replace").replace("\r\n", "\n")


def test_ctrl_c_reaches_the_chat_but_not_the_parent_that_waits_for_it():
    shown = _in_a_terminal("own")
    assert "TAKEN True True" in shown, shown
    assert "CHILD-GOT-INT" in shown and "RESTORED True" in shown, shown
    assert "PARENT-ALIVE 0" in shown and "KeyboardInterrupt" not in shown, shown


def test_without_it_ctrl_c_interrupts_the_parent_too():  # the fault it fixes (make chat)
    shown = _in_a_terminal("plain")
    assert "TAKEN False True" in shown and "CHILD-GOT-INT" in shown, shown
    assert "PARENT-ALIVE" not in shown and "KeyboardInterrupt" in shown, shown


def test_history_is_kept_bounded_private_and_never_fatal(tmp_path):
    pytest.importorskip("readline")
    hist = tmp_path / "sub" / "chat_history"
    code = """
        import sys, readline
        from pathlib import Path
        repl.HISTORY_LENGTH = 3
        path = Path(sys.argv[1])
        with repl.line_editing(path) as on:
            assert on
            for i in range(5):
                readline.add_history(f"line {i}")
        readline.clear_history()
        with repl.line_editing(path):
            print(readline.get_current_history_length(), readline.get_history_item(1))
        with repl.line_editing(path.parent):  # a folder: cannot be read or written
            pass
        print("ok")
    """
    r = subprocess.run(
        [sys.executable, "-c", _LOAD + textwrap.dedent(code), str(hist)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["3 line 2", "ok"]
    assert len([ln for ln in hist.read_text().splitlines() if not ln.startswith("_HiStOrY_")]) == 3
    assert hist.stat().st_mode & 0o077 == 0


def test_history_lives_in_the_cache_folder(tmp_path, monkeypatch):
    from mlx_stream.repl import history_path

    monkeypatch.setenv("MLX_STREAM_CACHE", str(tmp_path))
    assert history_path() == tmp_path / "chat_history"
