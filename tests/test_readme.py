"""README.md cannot drift from the code.

The rule: every fenced block of README.md names its language, bash/sh/shell or python. Each line
of a shell block (continuations joined, comments dropped) is one command of a known kind:

- `python ppo_nnx.py ...` or `python ppo_nnx_vae_lstm.py ...`: parsed by the script's own parser
  (`tyro.cli(script.Args)`) and checked by `script.check_args`; then run as `python SCRIPT ...`
  runs it (`runpy`, as `__main__`), in a folder of its own, with the tiny budget of
  `conftest.TINY_FLAGS` appended (tyro keeps a flag's last value) and `WANDB_MODE=offline`: it
  must exit 0 and print its summary. The commands of one script and environment run one after
  another in one process, which pays the imports once; compiled programs are shared through
  JAX's disk cache. Not run, only parsed: commands that need several devices or processes
  (`XLA_FLAGS`, `JAX_COORDINATOR_ADDRESS`) or a saved run (`--resume`, `--eval-checkpoint`).
  Skipped: a command whose `--env-id suites:SUITE/NAME` names a suite that is not installed.
- `python -m pytest`: must be CI's command (`.ci/run`), with `WANDB_MODE=offline`.
- `pip install -r FILE ...`: FILE must exist; a jax pinned there must be requirements.txt's.
- `python benchmarks/X.py`, `bash benchmarks/X.sh`: X must exist. `python suites.py`: counted.
- making and activating a virtual environment, `wandb login` and `wandb sync`: counted, not run.

Any other command fails the test, so a new kind of command needs a rule here. Python blocks must
compile, name only what the scripts have, and run with `Args` made tiny. The flags table's
defaults are the scripts' own, and every `--flag` the page names is a flag of a script.
"""

import ast
import functools
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import types
from pathlib import Path
from typing import NamedTuple

import pytest
import tyro

import ppo_nnx
import ppo_nnx_vae_lstm
import suites
from conftest import TINY_FLAGS

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SCRIPTS = {"ppo_nnx.py": ppo_nnx, "ppo_nnx_vae_lstm.py": ppo_nnx_vae_lstm}
SHELLS = ("bash", "sh", "shell")
# flags of other programs that the page names: learning.py's, ruff's, pip's, every program's --help
OTHER_FLAGS = {"only", "list", "check", "help", "no-deps"}


class Command(NamedTuple):
    line: str  # its words, continuations joined, without the comment
    env: dict  # the NAME=value words before the program
    argv: list

    @property
    def kind(self) -> str:
        return kind_of(self.argv)


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every ``` block."""
    return re.findall(r"^```([^\n`]*)\n(.*?)^```\s*$", text, flags=re.M | re.S)


def commands_of(body: str) -> list[Command]:
    """The commands of a shell block: `\\` continuations joined, comments and blank lines
    dropped, `&&` and `;` splitting a line."""
    commands = []
    for line in body.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words:
            cut = next((i for i, w in enumerate(words) if w in ("&&", ";")), len(words))
            part, words = words[:cut], words[cut + 1 :]
            env = {}
            while part and re.fullmatch(r"[A-Za-z_]\w*=.*", part[0]):
                name, value = part.pop(0).split("=", 1)
                env[name] = value
            if part:
                words_given = [f"{k}={v}" for k, v in env.items()] + part
                commands.append(Command(" ".join(words_given), env, part))
    return commands


def is_python(program: str) -> bool:
    return re.fullmatch(r"python(3(\.\d+)?)?", program) is not None


def is_script(argv: list) -> bool:
    return is_python(argv[0]) and len(argv) > 1 and argv[1] in SCRIPTS


def kind_of(argv: list) -> str:
    """The kind of a command, or AssertionError for one that no rule knows."""
    program, rest = argv[0], argv[1:]
    python = is_python(program)
    if is_script(argv):
        return "script"
    if python and rest[:2] == ["-m", "pytest"]:
        return "pytest"
    if python and rest[:2] == ["-m", "venv"]:
        return "venv"
    if program == "pip" or (python and rest[:2] == ["-m", "pip"]):
        return "pip"
    if program in (".", "source") and rest == [".venv/bin/activate"]:
        return "activate"
    if python and rest == ["suites.py"]:
        return "suites"
    if (python or program == "bash") and rest and rest[0].startswith("benchmarks/"):
        return "benchmark"
    if program == "wandb" and rest[:1] in (["login"], ["sync"]):
        return "wandb"
    raise AssertionError(f"no rule knows this command: {' '.join(argv)}")


def script_of(command: Command):
    return SCRIPTS[command.argv[1]]


def parse(command: Command):
    """The command's flags through its script's own parser and checks: its checked Args."""
    script, flags = script_of(command), command.argv[2:]
    try:
        args = tyro.cli(script.Args, args=flags)
    except SystemExit as error:  # tyro's message went to stderr
        raise AssertionError(f"tyro refused: {command.line}") from error
    try:
        return script.check_args(args)
    except ValueError as error:
        raise AssertionError(f"check_args refused {command.line}: {error}") from None


def missing_suite(command: Command) -> str:
    """The module of the suite its `--env-id suites:SUITE/NAME` names, if it is not installed."""
    for word in command.argv:
        if word.startswith("suites:"):
            _, module, _ = suites.SUITES[word[len("suites:") :].split("/")[0]]
            if importlib.util.find_spec(module) is None:
                return module
    return ""


def runnable(command: Command) -> bool:
    """One process on one device, with nothing saved before it (tests/test_devices.py runs the
    scripts on many devices and processes), its suite installed."""
    flags = {word.split("=")[0] for word in command.argv[2:]}
    return not (
        {"JAX_COORDINATOR_ADDRESS", "XLA_FLAGS"} & command.env.keys()
        or flags & {"--resume", "--eval-checkpoint"}
        or missing_suite(command)
    )


# Runs commands as `python SCRIPT FLAGS...` runs one, one after another in one process (the
# imports, seconds each, paid once), each in a folder of its own; a marker line ends each.
DRIVER = """
import json, os, runpy, sys
script, out, mark, commands = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
sys.path.insert(0, os.path.dirname(script))  # as `python SCRIPT` does: suites.py beside it
for i, flags in enumerate(commands):
    os.makedirs(f"{out}/{i}")
    os.chdir(f"{out}/{i}")
    sys.argv = [script, *flags]
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as error:
        code = error.code if isinstance(error.code, int) else int(error.code is not None)
    for stream in (sys.stdout, sys.stderr):
        print(f"\\n{mark} {code}", file=stream, flush=True)
"""
MARK = "@@ README command ended, exit code"


def run_tiny(commands: list, out: Path, cache: Path) -> list:
    """(exit code, stdout, stderr) of each command, all of one script and environment, with the
    tiny budget appended, in one process; compiled programs shared on disk."""
    env = {
        **os.environ,
        **commands[0].env,
        "WANDB_MODE": "offline",
        "JAX_COMPILATION_CACHE_DIR": str(cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    flags = json.dumps([c.argv[2:] + TINY_FLAGS for c in commands])
    script = str(ROOT / commands[0].argv[1])
    result = subprocess.run(
        [sys.executable, "-c", DRIVER, script, str(out), MARK, flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    end = re.compile(rf"\n{MARK} (-?\d+)\n")
    codes = [int(code) for code in end.findall(result.stdout)]
    assert len(codes) == len(commands), result.stderr[-3000:]
    outs, errs = (end.split(stream)[::2] for stream in (result.stdout, result.stderr))
    return list(zip(codes, outs, errs))


TEXT = README.read_text()
BLOCKS = fenced_blocks(TEXT)
COMMANDS = [c for lang, body in BLOCKS if lang in SHELLS for c in commands_of(body)]
SCRIPT_COMMANDS = [c for c in COMMANDS if is_script(c.argv)]


def group(command: Command) -> tuple:
    """Commands that can share a process: the same script and environment variables."""
    return command.argv[1], tuple(
        sorted({**command.env, "WANDB_MODE": "offline"}.items())
    )


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """command -> (exit code, stdout, stderr), each group's process started on first need."""
    cache, results = tmp_path_factory.mktemp("jax_cache"), {}

    def result(command: Command):
        if command.line not in results:
            same = [
                c for c in SCRIPT_COMMANDS if runnable(c) and group(c) == group(command)
            ]
            out = tmp_path_factory.mktemp("runs")
            results.update(zip([c.line for c in same], run_tiny(same, out, cache)))
        return results[command.line]

    return result


def test_every_block_is_checked():
    """No command hides in a block that the rules below never read."""
    assert BLOCKS
    for lang, body in BLOCKS:
        assert lang in SHELLS + ("python",), (
            f"a ``` block without a checked language:\n{body}"
        )


def test_every_command_is_of_a_known_kind():
    kinds = {}
    for command in COMMANDS:
        kinds[command.kind] = kinds.get(command.kind, 0) + 1
    # the contract with a new user: install, train, test
    assert {"venv", "activate", "pip", "script", "pytest"} <= kinds.keys(), kinds
    assert any(c.line == "python ppo_nnx.py --env-id CartPole-v1" for c in COMMANDS)


@pytest.mark.parametrize(
    "command", SCRIPT_COMMANDS, ids=[c.line[:80] for c in SCRIPT_COMMANDS]
)
def test_script_command(command, ran):
    if missing_suite(command):  # CI installs requirements-envs.txt
        pytest.skip(f"{missing_suite(command)} is not installed")
    parse(command)
    if runnable(command):
        code, out, err = ran(command)
        assert code == 0, err[-3000:]
        assert "summary:" in out
        if "--save-model" in command.argv:
            assert "saved the model: runs/" in out
        if "--eval-episodes" in command.argv:
            assert "eval: " in out


def test_test_command_is_ci_s():
    (pytest_command,) = [c for c in COMMANDS if c.kind == "pytest"]
    assert pytest_command.argv == ["python", "-m", "pytest"]
    assert pytest_command.env == {"WANDB_MODE": "offline"}
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "export WANDB_MODE=offline" in ci and "python -m pytest" in ci


def test_install_commands_name_files_that_exist():
    pinned = re.search(r"^jax==(\S+)", (ROOT / "requirements.txt").read_text(), re.M)
    for command in (c for c in COMMANDS if c.kind == "pip"):
        words = command.argv
        for i, word in enumerate(words):
            if word == "-r":
                assert (ROOT / words[i + 1]).is_file(), command.line
            if word.startswith("jax[") or word.startswith("jax=="):
                assert word.endswith(f"=={pinned[1]}"), command.line


def test_benchmark_commands_name_files_that_exist():
    benchmarks = [c for c in COMMANDS if c.kind == "benchmark"]
    assert benchmarks
    for command in benchmarks:
        assert (ROOT / command.argv[1]).is_file(), command.line


def tiny_module(module):
    """The module, with `Args` made tiny: the snippet's own keywords still win."""
    tiny = vars(tyro.cli(module.Args, args=TINY_FLAGS))
    defaults = vars(module.Args())
    changed = {k: v for k, v in tiny.items() if v != defaults[k]}
    proxy = types.ModuleType(module.__name__)
    proxy.__dict__.update(vars(module))
    proxy.Args = functools.partial(module.Args, **changed)
    return proxy


def test_python_blocks(monkeypatch):
    """Each compiles, names only what the scripts have, and runs with tiny Args."""
    blocks = [body for lang, body in BLOCKS if lang == "python"]
    assert blocks
    for body in blocks:
        tree = ast.parse(body)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                module = {m.__name__: m for m in SCRIPTS.values()}.get(node.value.id)
                assert module is None or hasattr(module, node.attr), node.attr
        for module in SCRIPTS.values():
            monkeypatch.setitem(sys.modules, module.__name__, tiny_module(module))
        exec(compile(tree, "README.md", "exec"), {})


def table_rows(heading: str) -> list[list[str]]:
    """The cells of the first table after `## heading`, header and rule dropped."""
    section = TEXT.split(f"\n## {heading}\n", 1)[1]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]


def value(cell: str):
    words = {"on": True, "off": False, "None": None, "()": ()}
    if cell in words:
        return words[cell]
    try:
        return float(cell)
    except ValueError:
        return cell


def defaults_differ(rows) -> list[str]:
    """The table's cells that are not the scripts' defaults."""
    wrong = []
    for flags, *defaults, _ in rows:
        for name in re.findall(r"`--([\w-]+)`", flags):
            field = name.replace("-", "_")
            for module, cell in zip(SCRIPTS.values(), defaults):
                has = field in vars(module.Args())
                if cell == "—" and not has:
                    continue
                if not has or value(cell) != getattr(module.Args(), field):
                    wrong.append(f"--{name} {module.__name__}: {cell}")
    return wrong


def test_flags_table_has_the_scripts_defaults():
    rows = table_rows("Flags")
    assert len(rows) > 20
    assert defaults_differ(rows) == []


def known_flag(name: str) -> bool:
    fields = {f for m in SCRIPTS.values() for f in vars(m.Args())}
    field = name.replace("-", "_")
    return (
        field in fields
        or (field.startswith("no_") and field[3:] in fields)
        or name in OTHER_FLAGS
        or name.startswith("xla_")  # XLA's own, in XLA_FLAGS
    )


def test_every_flag_named_exists():
    names = set(re.findall(r"(?<![\w-])--([a-z][\w-]*)", TEXT))
    assert "num-seeds" in names
    assert sorted(n for n in names if not known_flag(n)) == []


def test_controls():
    """The checks fail where they should: a misspelled flag, a value check_args refuses, a
    command no rule knows, an unlabelled block, a wrong default, a flag no script has."""
    (misspelled,) = commands_of("python ppo_nnx.py --num-seedz 8\n")
    with pytest.raises(AssertionError, match="tyro refused"):
        parse(misspelled)
    (refused,) = commands_of("python ppo_nnx.py --num-minibatches 3\n")
    with pytest.raises(AssertionError, match="must divide"):
        parse(refused)
    with pytest.raises(AssertionError, match="no rule knows"):
        kind_of(commands_of("make install  # comment\n")[0].argv)
    assert fenced_blocks("```\npython ppo_nnx.py\n```\n") == [
        ("", "python ppo_nnx.py\n")
    ]
    assert defaults_differ([["`--num-envs`", "8", "32", "envs"]]) == [
        "--num-envs ppo_nnx: 8"
    ]
    assert not known_flag("num-seedz") and known_flag("no-anneal-lr")
    joined = commands_of("A=1 python ppo_nnx.py \\\n    --num-seeds 2  # two\n")
    assert joined == [
        Command(
            "A=1 python ppo_nnx.py --num-seeds 2",
            {"A": "1"},
            ["python", "ppo_nnx.py", "--num-seeds", "2"],
        )
    ]
