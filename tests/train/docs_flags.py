"""The docs against the program: every flag that README.md and docs/{GUIDE,CLI,DEVELOPING}.md give a `shoal`
command (in a command line `shoal train ... --flag`, or in a copy of its --help) is one that
`shoal <command> --help` lists, and a copy of --help says what --help says; docs/GUIDE.md's table of
environment variables is the one `shoal env --markdown` prints, and every `SHOAL_*` variable the
sources name is a row of it (include/shoal/env.h); and include/shoal/shoal.h includes every public
header, as the README says ("One include gives everything").

Standard library only (no torch): it runs wherever Python does.

Usage: docs_flags.py SHOAL_BINARY (the source tree is this file's ../..)
"""
import concurrent.futures
import os
import re
import subprocess
import sys

SOURCE = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
DOCS = ["README.md"] + [os.path.join("docs", name) for name in
                         ("GUIDE.md", "CLI.md", "DEVELOPING.md")]
COMMANDS = ["train", "run", "bench", "ckpt", "plot", "env"]
# Where a shell command line stops: a comment, a pipe, a redirection, the next command.
STOP_TOKENS = {"#", "|", "||", "&&", ";", ">", "2>", ">>", "&"}
FLAG = re.compile(r"^--[A-Za-z][A-Za-z0-9_-]*")

failures = []


def fail(what):
    failures.append(what)
    print("FAIL:", what, flush=True)


def help_text(shoal, words):
    run = subprocess.run([shoal, *words, "--help"], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    if run.returncode != 0:
        fail(f"shoal {' '.join(words)} --help exited {run.returncode}: {run.stderr[-400:]}")
    return run.stdout


class Command:
    """What `shoal WORDS --help` lists: its flags (and whether each takes a value) and its
    subcommands."""

    def __init__(self, shoal, words):
        self.words = words
        self.flags = {}  # name -> takes a value
        self.subcommands = []
        in_subcommands = False
        for line in help_text(shoal, words).splitlines():
            if re.match(r"^\S.*:\s*$", line):
                in_subcommands = line.strip().lower().startswith("subcommands")
                continue
            match = re.match(r"^\s+(-\S+)(\s+(\S+))?", line)
            if match and not in_subcommands:
                # A value's type is in capitals (TEXT=cnn, INT, FILE, [FLOAT,FLOAT]); a flag's
                # description follows its name directly.
                value = re.match(r"^(\[|[A-Z][A-Z0-9_]+(=|:|$))", match.group(3) or "")
                for name in match.group(1).split(","):
                    if name.startswith("--"):
                        self.flags[name] = bool(value)
            elif in_subcommands:
                sub = re.match(r"^\s+([a-z][a-z0-9_-]*)\b", line)
                if sub:
                    self.subcommands.append(sub.group(1))


def load_commands(shoal):
    # Each --help loads LibTorch (seconds on a loaded machine): four at a time.
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        tops = dict(zip(COMMANDS, pool.map(lambda name: Command(shoal, [name]), COMMANDS)))
        keys = [(name, sub) for name in COMMANDS for sub in tops[name].subcommands]
        subs = pool.map(lambda key: Command(shoal, list(key)), keys)
        commands = dict(tops)
        commands.update({f"{name} {sub}": command for (name, sub), command in zip(keys, subs)})
    return commands


def split_markdown(text):
    """(code block lines as lists, the prose with code blocks removed)."""
    blocks, prose, block = [], [], None
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if block is None:
                block = []
            else:
                blocks.append(block)
                block = None
            continue
        (prose if block is None else block).append(line)
    return blocks, "\n".join(prose)


def command_lines(blocks, prose):
    """Every shell line of the docs that may run `shoal`: code block lines, inline code spans."""
    for block in blocks:
        yield from block
    for span in re.findall(r"`([^`]+)`", prose):
        yield span.replace("\n", " ")


def documented_uses(line, commands):
    """(command key, flag) for each flag that `line` gives to a shoal command."""
    tokens = line.replace("\\", " ").split()
    i = 0
    while i < len(tokens):
        word = os.path.basename(tokens[i])
        if word != "shoal" or i + 1 >= len(tokens) or tokens[i + 1] not in COMMANDS:
            i += 1
            continue
        keys = [tokens[i + 1]]
        i += 2
        # A subcommand, or several (`shoal ckpt inspect|convert --max-values N`).
        subs = tokens[i].split("|") if i < len(tokens) else []
        if subs and all(f"{keys[0]} {sub}" in commands for sub in subs):
            keys = [f"{keys[0]} {sub}" for sub in subs]
            i += 1
        while i < len(tokens):
            token = tokens[i]
            if token in STOP_TOKENS or token.startswith("#") or os.path.basename(token) == "shoal":
                break
            flag = FLAG.match(token)
            if flag:
                for key in keys:
                    yield key, flag.group(0)
                takes_value = commands[keys[0]].flags.get(flag.group(0), False)
                i += 2 if takes_value and "=" not in token else 1
                continue
            if keys == ["run"] and not token.startswith("-"):
                break  # the worker's program: what follows are its own arguments
            i += 1


def help_copies(blocks, commands):
    """(command key, flag) for the option lines of a --help copy: a code block that starts with
    `shoal <command> [OPTIONS]`."""
    for block in blocks:
        if not block:
            continue
        head = re.match(r"^\s*shoal ((\S+)( \S+)?) \[OPTIONS\]", block[0])
        if not head:
            continue
        key = head.group(1) if head.group(1) in commands else head.group(2)
        for line in block[1:]:
            if re.match(r"^\s+--", line):
                # The flags column ends at the first gap of two spaces: "--a, --b  what they do".
                names = re.split(r"\s{2,}", line.strip())[0]
                for name in re.findall(r"--[A-Za-z][A-Za-z0-9_-]*", names):
                    yield key, name


def collapse(line):
    return " ".join(line.split())


def check_help_copies(shoal):
    """A code block that starts with `shoal <command> [OPTIONS]` is a copy of that command's
    --help: each of its lines must be one of --help's (spaces aside), or the copy has drifted."""
    copies = 0
    for doc in DOCS:
        with open(os.path.join(SOURCE, doc), encoding="utf-8") as f:
            blocks, _ = split_markdown(f.read())
        for block in blocks:
            head = re.match(r"^\s*shoal ((\S+)( \S+)?) \[OPTIONS\]", block[0]) if block else None
            if not head:
                continue
            copies += 1
            words = head.group(1).split()
            actual = {collapse(line) for line in help_text(shoal, words).splitlines()}
            for line in block:
                if collapse(line) and collapse(line) not in actual:
                    fail(f"{doc}: a copy of `shoal {' '.join(words)} --help` has the line "
                         f"{line.strip()!r}, which the real --help does not: point to --help "
                         "instead of copying it")
    return copies


def env_table_rows(text):
    """The rows of the Markdown table whose header starts `| Variable | Values |`."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("| Variable | Values |"):
            rows = []
            for row in lines[i:]:
                if not row.startswith("|"):
                    break
                rows.append(row.rstrip())
            return rows
    return []


def check_env_table(shoal):
    run = subprocess.run([shoal, "env", "--markdown"], capture_output=True, text=True, timeout=60)
    if run.returncode != 0:
        fail(f"shoal env --markdown exited {run.returncode}: {run.stderr[-400:]}")
        return 0
    registry = [line.rstrip() for line in run.stdout.splitlines() if line.strip()]
    with open(os.path.join(SOURCE, "docs", "GUIDE.md"), encoding="utf-8") as f:
        documented = env_table_rows(f.read())
    if not documented:
        fail("docs/GUIDE.md has no table of environment variables (`| Variable | Values | ...`); "
             "paste `shoal env --markdown`")
    for row in sorted(set(registry) - set(documented)):
        fail(f"docs/GUIDE.md's table of environment variables lacks (or differs in) the row {row}")
    for row in sorted(set(documented) - set(registry)):
        fail(f"docs/GUIDE.md's table of environment variables has a row that `shoal env "
             f"--markdown` does not print: {row}")
    if documented and documented != registry and set(documented) == set(registry):
        fail("docs/GUIDE.md's table of environment variables is not in the order of the registry")
    names = set(re.findall(r"^\| `([A-Z][A-Z0-9_]+)` \|", run.stdout, re.M))
    # Every SHOAL_* variable the sources name in a string ("SHOAL_TIMEOUT") is in the registry,
    # and only src/env/ reads one with getenv.
    for top in ("src", "apps", "include"):
        for folder, _, files in os.walk(os.path.join(SOURCE, top)):
            for name in files:
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8", errors="replace") as f:
                    code = f.read()
                where = os.path.relpath(path, SOURCE)
                for variable in sorted(set(re.findall(r'"(SHOAL_[A-Z0-9_]+)"', code)) - names):
                    if not re.search(r"#\s*define\s+" + variable + r"\b", code) and \
                            not re.search(r"-D" + variable + r"=|" + variable + r'="', code):
                        fail(f"{where} names the variable {variable}, which is not a row of "
                             "include/shoal/env.h's table")
                if "getenv(\"SHOAL_" in code and not where.startswith(os.path.join("src", "env")):
                    fail(f"{where} reads a SHOAL_* variable with getenv: read it through shoal/env.h")
    return len(names)


def check_flags(commands):
    checked = 0
    for doc in DOCS:
        with open(os.path.join(SOURCE, doc), encoding="utf-8") as f:
            blocks, prose = split_markdown(f.read())
        uses = set(help_copies(blocks, commands))
        for line in command_lines(blocks, prose):
            uses.update(documented_uses(line, commands))
        for key, flag in sorted(uses):
            checked += 1
            if flag not in commands[key].flags:
                fail(f"{doc} gives `shoal {key}` the flag {flag}, which `shoal {key} --help` "
                     "does not list")
    # 93 distinct (command, flag) pairs when this test was written: far fewer means the command
    # lines were not found, and the check would pass having compared nothing.
    if checked < 60:
        fail(f"only {checked} documented flags found: the docs' command lines were not read")
    return checked


def check_umbrella_header():
    include = os.path.join(SOURCE, "include")
    with open(os.path.join(include, "shoal", "shoal.h"), encoding="utf-8") as f:
        included = set(re.findall(r'#include "([^"]+)"', f.read()))
    headers = 0
    for folder, _, files in os.walk(os.path.join(include, "shoal")):
        for name in files:
            path = os.path.relpath(os.path.join(folder, name), include)
            if not name.endswith(".h") or path == "shoal/shoal.h":
                continue
            headers += 1
            if path not in included:
                fail(f"include/shoal/shoal.h does not include {path}")
    return headers


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: docs_flags.py SHOAL_BINARY")
    commands = load_commands(sys.argv[1])
    checked = check_flags(commands)
    copies = check_help_copies(sys.argv[1])
    variables = check_env_table(sys.argv[1])
    headers = check_umbrella_header()
    if failures:
        print(f"{len(failures)} checks failed")
        sys.exit(1)
    print(f"ORACLE OK docs_flags: {checked} documented flags of {len(commands)} commands are in "
          f"their --help; {copies} copies of --help match it; the {variables} environment variables of "
          f"`shoal env` are docs/GUIDE.md's; shoal.h includes all {headers} public headers",
          flush=True)


main()
