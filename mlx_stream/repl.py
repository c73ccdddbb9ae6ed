"""The interactive loop of ``mlx-stream chat``: a REPL over a :class:`~mlx_stream.chat.ChatSession`.

:func:`run_chat` reads lines, sends them to the session and streams the replies; lines
that start with ``/`` are commands (``/help`` lists them, ``//text`` sends ``/text``).
On a terminal it adds line editing and a history file (the standard library's
``readline``, where the platform has it) and takes the terminal's foreground for its own
process group (:func:`own_foreground_group`), so that Ctrl-C stops a reply without also
interrupting a parent such as ``make chat``.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import re
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

HISTORY_LENGTH = 1000  # lines kept in the history file
PROMPT = ">> "

# command -> what it does (the /help text); /quit is an alias of /exit
COMMANDS = {
    "/help": "list the commands",
    "/reset": "forget the conversation (the system prompt stays) and clear the cache",
    "/exit": "quit (also /quit, or Ctrl-D at the prompt)",
}
_ALIASES = {"/quit": "/exit"}
_COMMAND_WORD = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")


def history_path() -> Path:
    """The chat's line history: ``chat_history`` in :func:`mlx_stream.loader.cache_dir`."""
    from .loader import cache_dir

    return cache_dir() / "chat_history"


def describe_settings(generation: dict) -> str:
    """One sentence on a session's reply settings (``ChatSession.generation``) and the
    options that change them, e.g. ``Replies up to 256 tokens, greedy (--max-tokens,
    --temp to change)``. Missing keys take :func:`mlx_stream.stream_generate`'s defaults."""
    max_tokens = generation.get("max_tokens", 256)
    temp = generation.get("temp", 0.0) or 0.0
    if temp <= 0:
        how = "greedy"
    else:
        parts = [f"temp {temp:g}"]
        if generation.get("top_p", 1.0) < 1.0:
            parts.append(f"top-p {generation['top_p']:g}")
        if generation.get("top_k", 0) > 0:
            parts.append(f"top-k {generation['top_k']}")
        if generation.get("min_p", 0.0) > 0:
            parts.append(f"min-p {generation['min_p']:g}")
        how = "sampled at " + ", ".join(parts)
    return f"Replies up to {max_tokens} tokens, {how} (--max-tokens, --temp to change)"


def help_text(line_editing: bool = False) -> str:
    """What ``/help`` prints."""
    width = max(map(len, COMMANDS)) + 2
    lines = ["Commands:"]
    lines += [f"  {name:<{width}}{what}" for name, what in COMMANDS.items()]
    lines.append(f"  {'//text':<{width}}send '/text' as a message (for a message that starts with '/')")
    lines.append("Anything else is sent to the model. Ctrl-C stops a reply; at the prompt it quits.")
    if line_editing:
        lines.append(f"Arrow keys edit the line and recall earlier ones (history in {history_path()}).")
    return "\n".join(lines)


def parse_line(line: str) -> tuple[str, str]:
    """Classify one input line (control characters already removed).

    Returns ``(kind, value)``: ``("empty", "")``; ``("message", text)`` for text to send
    (``//text`` gives ``/text``; a line whose first word after the ``/`` is not
    command-like, such as ``/usr/bin ...``, is a message as it stands); ``("command",
    name)`` for a known command alone on its line (``/quit`` gives ``/exit``);
    ``("error", message)`` for an unknown command or a command with arguments.
    """
    s = line.strip()
    if not s:
        return "empty", ""
    if s.startswith("//"):
        return "message", line.lstrip()[1:]
    if not s.startswith("/"):
        return "message", line
    first, *rest = s.split(maxsplit=1)
    if not _COMMAND_WORD.fullmatch(first[1:]):
        return "message", line
    name = first.lower()
    name = _ALIASES.get(name, name)
    if name not in COMMANDS:
        return "error", f"unknown command {first}; /help lists the commands"
    if rest:
        return "error", (
            f"{first} takes no arguments (//text sends a message that starts with '/'); "
            "/help lists the commands"
        )
    return "command", name


def stats_line(last) -> str:
    """The statistics of a finished reply from its last response, e.g. ``[57 tokens,
    7.4 tok/s, tau 1.31, prompt 12 new + 340 cached tokens]``: ``new`` tokens were
    prefilled this turn, ``cached`` ones reused from the previous turns' KV cache."""
    cached = last.cached_tokens
    return (
        f"[{last.generation_tokens} tokens, {last.generation_tps:.1f} tok/s, tau {last.tau:.2f}, "
        f"prompt {last.prompt_tokens - cached} new + {cached} cached tokens]"
    )


@contextlib.contextmanager
def _ignoring(sig: int) -> Iterator[None]:
    old = signal.signal(sig, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(sig, old)


@contextlib.contextmanager
def own_foreground_group(fd: int | None = None) -> Iterator[bool]:
    """Run the block in a process group of its own that holds the terminal's foreground.

    Under ``make chat`` the chat shares make's process group, so the terminal's Ctrl-C
    (SIGINT to the whole foreground group) also reaches make, which then reports
    ``Interrupt`` when the chat ends. Where ``fd`` (default: stdin) is a terminal, this
    process is in the terminal's foreground group and not already its group's leader,
    the block runs in a new group (``setpgid(0, 0)``) made the foreground
    (``tcsetpgrp``), so Ctrl-C reaches only this process; on the way out the previous
    group gets the foreground back and the process rejoins it. While it holds the
    foreground, SIGTSTP (Ctrl-Z) is ignored: a stopped chat under make could not be
    resumed by the shell, which only knows make's group.

    Anywhere else (not a terminal, a background job, already a group leader as when
    started from an interactive shell, no job control on the platform) it does nothing.
    Yields whether it took the foreground. Failures never raise.
    """
    taken = False
    old_pgrp = 0
    old_tstp = None
    try:
        if fd is None:
            fd = sys.stdin.fileno()
        if (
            hasattr(os, "tcsetpgrp")
            and os.isatty(fd)
            and os.getpgrp() != os.getpid()
            and os.tcgetpgrp(fd) == os.getpgrp()
        ):
            old_pgrp = os.getpgrp()
            os.setpgid(0, 0)
            try:
                with _ignoring(signal.SIGTTOU):
                    os.tcsetpgrp(fd, os.getpgrp())
            except OSError:
                os.setpgid(0, old_pgrp)
                raise
            taken = True
            old_tstp = signal.signal(signal.SIGTSTP, signal.SIG_IGN)
    except (OSError, ValueError, AttributeError):  # no fileno, no job control, a race with the shell
        pass
    try:
        yield taken
    finally:
        if taken:
            with contextlib.suppress(OSError, ValueError):
                with _ignoring(signal.SIGTTOU):
                    os.tcsetpgrp(fd, old_pgrp)
            with contextlib.suppress(OSError):
                os.setpgid(0, old_pgrp)
            with contextlib.suppress(OSError, ValueError, TypeError):
                signal.signal(signal.SIGTSTP, old_tstp)


@contextlib.contextmanager
def line_editing(history: Path | None = None) -> Iterator[bool]:
    """Line editing and a persistent history for ``input()`` via the standard library's
    ``readline`` (GNU readline or libedit), with Tab completing the ``/`` commands.

    Reads ``history`` (default :func:`history_path`) on entry and writes it back on the
    way out, at most :data:`HISTORY_LENGTH` lines, readable by the owner only; a
    history that cannot be read or written is skipped silently. Yields whether
    ``readline`` is available (it is not on some platforms; ``input()`` then works
    without editing).
    """
    try:
        import readline
    except ImportError:
        yield False
        return
    path = history if history is not None else history_path()
    with contextlib.suppress(OSError, ValueError):
        readline.set_history_length(HISTORY_LENGTH)
        if path.exists():
            readline.read_history_file(str(path))
    names = sorted([*COMMANDS, *_ALIASES])

    def complete(text: str, state: int) -> str | None:
        if readline.get_begidx() != 0:
            return None
        hits = [n + " " for n in names if n.startswith(text)] if text.startswith("/") else []
        return hits[state] if state < len(hits) else None

    old_completer, old_delims = readline.get_completer(), readline.get_completer_delims()
    readline.set_completer(complete)
    readline.set_completer_delims(" \t\n")
    libedit = "libedit" in (readline.__doc__ or "")
    readline.parse_and_bind("bind ^I rl_complete" if libedit else "tab: complete")
    try:
        yield True
    finally:
        readline.set_completer(old_completer)
        readline.set_completer_delims(old_delims)
        with contextlib.suppress(OSError, ValueError):
            path.parent.mkdir(parents=True, exist_ok=True)
            readline.set_history_length(HISTORY_LENGTH)
            readline.write_history_file(str(path))
            os.chmod(path, 0o600)


def _clean(line: str) -> str:
    return "".join(ch for ch in line if ch.isprintable() or ch in "\t\n")


def run_chat(
    session,
    *,
    model_name: str,
    settings: str | None = None,
    input_fn: Callable[[str], str] | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
    terminal: bool | None = None,
) -> None:
    """Chat with ``session`` until ``/exit``, ``/quit``, end of input or Ctrl-C at the prompt.

    Prints a banner (``model_name``, whether the model has stream heads, ``settings``,
    the commands), then for each input line: a command (``/help``, ``/reset``,
    ``/exit``), an error for an unknown ``/command``, or a message whose reply is
    streamed to ``out``, followed by a statistics line on ``err`` (see
    :func:`stats_line`). Ctrl-C during a reply prints ``[stopped]`` and the session
    stays usable; a ``ValueError`` from the session (a transcript too long for the
    context window, ...) is printed as ``error: ...`` and the loop goes on.

    Args:
        session: a :class:`~mlx_stream.chat.ChatSession`.
        model_name: the model as the user named it, for the banner.
        settings: the banner's sentence on the reply settings (and the options that
            change them); by default :func:`describe_settings` of ``session.generation``.
        input_fn: reads a line given the prompt (default: the built-in ``input``);
            raises ``EOFError`` at end of input.
        out, err: the reply and statistics streams (default: ``sys.stdout``, ``sys.stderr``).
        terminal: whether to use the terminal features (line editing and history,
            :func:`own_foreground_group`); by default, when ``input_fn`` is the built-in
            ``input`` and stdin is a terminal.
    """
    input_fn = input_fn or builtins.input
    out = out or sys.stdout
    err = err or sys.stderr
    if terminal is None:
        try:
            terminal = input_fn is builtins.input and sys.stdin.isatty()
        except (AttributeError, ValueError):
            terminal = False
    if settings is None:
        settings = describe_settings(getattr(session, "generation", {}))
    settings = settings.rstrip(". ")
    mode = "stream heads" if getattr(session.model, "heads", None) is not None else "plain decoding"
    if getattr(getattr(session.model, "datastore", None), "learn", False):
        mode += (
            "; its answers are kept to draft from: --no-learn to stop, `mlx-stream answers --clear` to forget"
        )
    with contextlib.ExitStack() as stack:
        editing = False
        if terminal:
            stack.enter_context(own_foreground_group())
            editing = stack.enter_context(line_editing())
        _say(
            out,
            f"mlx-stream chat: {model_name} ({mode}).\n"
            f"{settings}. /help for commands, Ctrl-C stops a reply.\n",
        )
        while True:
            try:
                line = input_fn(PROMPT)
            except (EOFError, KeyboardInterrupt):
                _say(out, "\n")
                return
            kind, value = parse_line(_clean(line))
            if kind == "empty":
                continue
            if kind == "error":
                _say(err, value + "\n")
                continue
            if kind == "command":
                if value == "/exit":
                    return
                if value == "/reset":
                    session.reset()
                    _say(out, "[conversation cleared]\n")
                elif value == "/help":
                    _say(out, help_text(editing) + "\n")
                continue
            _reply(session, value, out, err)


def _say(stream: TextIO, text: str) -> None:
    stream.write(text)
    stream.flush()


def _reply(session, text: str, out: TextIO, err: TextIO) -> None:
    last = None
    try:
        for last in session.send(text):
            _say(out, last.text)
        _say(out, "\n")
    except KeyboardInterrupt:
        _say(out, "\n[stopped]\n")
    except ValueError as e:
        if last is not None:
            _say(out, "\n")
        _say(err, f"error: {e}\n")
        return
    if last is not None:
        _say(err, stats_line(last) + "\n")
