"""docs/reference.md: every option (the pytest plugin's, with its ini twin, and every ``rlhfmem`` subcommand's) and
every environment variable the package reads or sets, in ONE table generated from the code.

    python -m doctables.reference          # the table

Options come from the parsers themselves (the plugin's pytest group, the CLI's argparse tree). Environment variables
come from a scan of ``pytest_rlhfmem/`` (:func:`scan_environment`: every ``os.environ`` / ``os.getenv`` access, its
name resolved through the module's constants and imports) joined with :data:`ENVIRONMENT`, the words for each name:
a name the code reads or sets that has no words here stops the generator (and fails tests/test_reference_table.py),
so the table cannot miss one; words for a name the code no longer uses make no row.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pytest_rlhfmem"

# Who sets a variable: ``yours`` (a setting for you), ``internal`` (the launcher sets it for its ranks: never set it
# yourself), ``others`` (read from another tool: torchrun, CUDA, the compiler, CI), ``set`` (set by rlhfmem for a
# library in the processes it starts).
KINDS = {
    "yours": "env, yours",
    "internal": "env, internal (set by the launcher for its ranks)",
    "others": "env, read from another tool",
    "set": "env, set by rlhfmem for a library",
}

# name -> (kind, meaning). Every name the scan finds must be here, and every name here must be found.
ENVIRONMENT: dict[str, tuple[str, str]] = {
    "RLHFMEM_CACHE_DIR": ("yours", "where the C++ builds are cached (default `$XDG_CACHE_HOME/pytest-rlhfmem`, "
                                   "`~/.cache/pytest-rlhfmem`); a first run builds into it, later runs load from it"),
    "RLHFMEM_SNAPSHOTS_DIR": ("yours", "the real GPU snapshots the fidelity tests read (default `../shared/snapshots`"
                                       " beside the checkout: docs/shared-snapshots.md)"),
    "RLHFMEM_HISTORY_MAX_ENTRIES": ("yours", "CUDA route: the memory history's ring buffer, in entries (a positive "
                                             "integer; default in record/recorder.py); a wrapped history is reported"),
    "RLHFMEM_HISTORY_CONTEXT": ("yours", "CUDA route: the stack frames the memory history records: `none` (default),"
                                         " `state`, `alloc`, `all`"),
    "RLHFMEM_CPU_FP16_KERNELS": ("yours", "DeepSpeed's answer to 'has this CPU fp16 kernels': `auto` (default), "
                                          "`supported`, `unsupported` (the CPU portability tests)"),
    "RLHFMEM_SNAPSHOT_READER": ("yours", "`python`: read snapshot pickles with Python's unpickler instead of the "
                                         "compiled reader (the benchmark's 'before')"),
    "RLHFMEM_SEGMENT_PLACEMENT": ("yours", "the driver's segment placement the replay models (`rlhfmem replay "
                                          "--segment-placement` sets it for a capture's ranks)"),
    "RLHFMEM_NVME_DIR": ("yours", "ZeRO-Infinity's swap directory (default: under the run's work directory)"),
    "RLHFMEM_SIM_CUDA_VALUES": ("yours", "the simulated CUDA device computes values: `on` (the default of "
                                         "`rlhfmem capture --device cuda-sim`) or `off`"),
    "RLHFMEM_SIM_CUDA_SDPA": ("yours", "scaled_dot_product_attention's backend on the simulated device "
                                       "(default `math`)"),
    "RLHFMEM_SIM_CUDA_RECORD_STREAM": ("yours", "when a block freed after `record_stream` returns to the pool on "
                                                "the simulated device (default `immediate`)"),
    "RLHFMEM_FAKECUDA_SAVE_TRACE": ("yours", "set: the fake-CUDA route writes each run's trace beside its result "
                                             "(`.rlhftrace`)"),
    "RLHFMEM_CAPTURE_DIR": ("internal", "the capture's work directory; its presence turns the bootstrap on in "
                                        "every process of the command"),
    "RLHFMEM_CAPTURE_DEVICE": ("internal", "the capture's device: `cpu`, `cuda`, `cuda-sim`, `cuda-rehearsal`"),
    "RLHFMEM_CAPTURE_ID": ("internal", "the scenario id of the capture"),
    "RLHFMEM_CAPTURE_COMMAND": ("internal", "the captured command, a JSON list"),
    "RLHFMEM_CAPTURE_WORLD_SIZE": ("internal", "the capture's world size when the command is not torchrun"),
    "RLHFMEM_CAPTURE_TORCHRUN": ("internal", "`1`: only torchrun's workers (with `LOCAL_RANK`) are ranks"),
    "RLHFMEM_CAPTURE_SNAPSHOT_DIR": ("internal", "where each rank saves its memory_viz snapshot"),
    "RLHFMEM_CAPTURE_CUDA_EMULATION": ("internal", "`on` / `off`: the CPU capture's CUDA emulation"),
    "RLHFMEM_RECORDER_LIBRARY": ("internal", "the CPU allocation recorder built once by the launcher; a rank loads "
                                             "it without building"),
    "RLHFMEM_SIM_CUDA_LIBRARY": ("internal", "the simulated CUDA device's library built by the launcher"),
    "RLHFMEM_SIM_DIST_LIBRARY": ("internal", "the simulated device's process group (a torch extension) built by "
                                             "the launcher"),
    "RLHFMEM_SIM_CUDA_DEVICES": ("internal", "how many simulated CUDA devices a process sees (one per local rank)"),
    "RLHFMEM_ITERATIONS": ("internal", "the iterations a capture asks the program to run (`iterations=N` of "
                                       "`rlhfmem_command`, `rlhfmem capture --iterations`), for a program that reads"
                                       " it"),
    "RLHFMEM_RUN_": ("internal", "`RLHFMEM_RUN_` + a random token, value `1`: marks every process of one run, so "
                                 "that only its own processes are ever signalled"),
    "CXX": ("others", "the C++ compiler of every build (default `g++`)"),
    "XDG_CACHE_HOME": ("others", "the base of the default build cache and the budget files' locks (default "
                                 "`~/.cache`)"),
    "CUDA_VISIBLE_DEVICES": ("others", "the GPUs a run sees: the budget profile counts them "
                                       "(`cuda-<gpu>-x<visible GPUs>`)"),
    "GITHUB_STEP_SUMMARY": ("others", "set (GitHub Actions): every session appends its diff against the budgets "
                                      "to the step summary, with or without `--rlhfmem-report`"),
    "ONEDNN_MAX_CPU_ISA": ("others", "oneDNN's ISA cap, recorded in a result's `host_cpu` (portability tests)"),
    "ATEN_CPU_CAPABILITY": ("others", "ATen's CPU dispatch level, forced by the CPU portability tests"),
    "CUBLAS_WORKSPACE_CONFIG": ("others", "cuBLAS's workspace setting: sizes the emulated cuBLAS workspace of a "
                                          "CPU capture"),
    "RANK": ("others", "torchrun's rank of the process"),
    "LOCAL_RANK": ("others", "torchrun's local rank (the GPU a rank uses)"),
    "WORLD_SIZE": ("others", "torchrun's world size"),
    "LOCAL_WORLD_SIZE": ("others", "torchrun's ranks on this node (simulated devices a process sees)"),
    "PATH": ("set", "`rlhfmem deps-diff`: each dependency set's `bin` first, so its torchrun and accelerate run"),
    "VIRTUAL_ENV": ("set", "`rlhfmem deps-diff`: each dependency set's prefix (this process's is not passed on)"),
    "PYTHONPATH": ("set", "the capture's bootstrap (`sitecustomize`) is put first on it for the command's "
                          "processes"),
    "DS_ACCELERATOR": ("set", "`cuda` on the simulated CUDA device (DeepSpeed's CUDA accelerator), `cpu` on the "
                              "CPU route"),
    "HF_HUB_OFFLINE": ("set", "`1` for the recipes' runs (models are built from configs, nothing is downloaded)"),
    "TRANSFORMERS_OFFLINE": ("set", "`1` for the recipes' runs, as `HF_HUB_OFFLINE`"),
    "TORCH_EXTENSIONS_DIR": ("others", "where torch builds DeepSpeed's JIT ops (default `~/.cache/torch_extensions`;"
                                       " tox sets one per environment): a run cut short removes the build locks it "
                                       "left there"),
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": ("set", "`1` (unless set) for the recipes' NCCL groups on a GPU"),
    "OMP_NUM_THREADS": ("set", "the threads of each rank"),
    "TOKENIZERS_PARALLELISM": ("set", "`false` in the recipes' ranks"),
    "PYTHONUNBUFFERED": ("set", "`1`: the ranks' lines reach the launcher's log as printed"),
}

NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")  # an environment variable's name (a dict key that is not one is data)
_ENVIRON_METHODS = {"get", "pop", "setdefault", "update", "__contains__"}


def _is_environ(node: ast.AST, aliases: set[str]) -> bool:
    """``os.environ``, or a local name bound to ``os.environ``."""
    if isinstance(node, ast.Attribute) and node.attr == "environ":
        return True
    return isinstance(node, ast.Name) and node.id in aliases


def _env_like(node: ast.AST) -> bool:
    """A name that holds an environment by this package's naming: ``env``, ``run_env``, ``*_env``."""
    return isinstance(node, ast.Name) and (node.id in ("env", "run_env") or node.id.endswith("_env"))


def _resolvable(node: ast.AST) -> bool:
    return isinstance(node, (ast.Constant, ast.Name, ast.BinOp, ast.JoinedStr, ast.Attribute))


def _module_constants(tree: ast.Module) -> dict[str, str]:
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out[t.id] = node.value.value
    return out


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve_from(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _scan_module(f: Path, tree: ast.Module, constants: dict[str, dict[str, str]], modules: dict[str, Path],
                 found: dict[str, set[str]]) -> None:
    """Add to ``found`` the environment names module ``f`` reads or sets."""
    mod = _module_name(f)
    names = dict(constants[mod])  # NAME -> value, this module's and its imports'
    mod_aliases: dict[str, str] = {}  # alias -> module
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            src = _resolve_from(mod, node, f.name == "__init__.py")
            for a in node.names:
                if a.name in constants.get(src, {}):
                    names[a.asname or a.name] = constants[src][a.name]
                elif f"{src}.{a.name}" in modules:
                    mod_aliases[a.asname or a.name] = f"{src}.{a.name}"
    aliases = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
               for t in node.targets if isinstance(t, ast.Name)
               and any(_is_environ(n, set()) for n in ast.walk(node.value))
               and not isinstance(node.value, ast.Call)}

    def value(arg: ast.AST, line: int) -> str:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value
        if isinstance(arg, ast.Name) and arg.id in names:
            return names[arg.id]
        if (isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name)
                and arg.value.id in mod_aliases and arg.attr in constants.get(mod_aliases[arg.value.id], {})):
            return constants[mod_aliases[arg.value.id]][arg.attr]
        if isinstance(arg, ast.BinOp) and isinstance(arg.op, ast.Add):  # PREFIX + token: the prefix stands
            return value(arg.left, line)
        if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
            return str(arg.values[0].value)  # f"{PREFIX}..." is resolved below; a literal prefix stands
        if isinstance(arg, ast.JoinedStr) and isinstance(arg.values[0], ast.FormattedValue):
            return value(arg.values[0].value, line)
        raise ValueError(f"{f.relative_to(ROOT)}:{line}: an environment access whose name is not a constant")

    def add(name: str) -> None:
        found.setdefault(name, set()).add(mod)

    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            fn = node.func
            if isinstance(fn, ast.Attribute) and fn.attr == "getenv" and node.args:
                add(value(node.args[0], node.lineno))
            elif isinstance(fn, ast.Attribute) and fn.attr in _ENVIRON_METHODS and _is_environ(fn.value, aliases):
                if node.args and fn.attr != "update":
                    add(value(node.args[0], node.lineno))
                for kw in node.keywords:
                    if kw.arg:
                        add(kw.arg)
            elif (isinstance(fn, ast.Name) and fn.id == "dict" and node.args
                  and _is_environ(node.args[0], aliases)):
                for kw in node.keywords:
                    if kw.arg:
                        add(kw.arg)
        elif isinstance(node, ast.Dict) and None in node.keys:  # {**env, NAME: value}: a child's environment
            for k in node.keys:
                if k is not None and NAME.match(value(k, node.lineno) if _resolvable(k) else ""):
                    add(value(k, node.lineno))
        elif isinstance(node, ast.Subscript) and _is_environ(node.value, aliases):
            add(value(node.slice, node.lineno))
        elif (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn))
              and _is_environ(node.comparators[0], aliases)):
            add(value(node.left, node.lineno))
    # a mapping that holds an environment (`env = dict(os.environ)`, a parameter `env`, `run_env`): the
    # UPPER_CASE names it is read or written with
    for node in ast.walk(tree):
        key = None
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args
                and node.func.attr in ("get", "pop", "setdefault") and _env_like(node.func.value)):
            key = node.args[0]
        elif isinstance(node, ast.Subscript) and _env_like(node.value):
            key = node.slice
        keys = [key] if key is not None else []
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update"
                and _env_like(node.func.value) and node.args and isinstance(node.args[0], ast.Dict)):
            keys = [k for k in node.args[0].keys if k is not None]
        for k in keys:
            try:
                name = value(k, node.lineno)
            except ValueError:  # a loop variable: its names are constants the loop reads elsewhere
                continue
            if NAME.match(name):
                add(name)


def scan_environment(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Every environment variable name the package's code reads or sets, with the modules that do
    (``{name: {"pytest_rlhfmem.cbuild", ...}}``). An access whose name cannot be resolved to a string raises
    ``ValueError`` naming the file and line: the table would miss it."""
    files = sorted(package.rglob("*.py"))
    trees = {f: ast.parse(f.read_text(), str(f)) for f in files}
    modules = {_module_name(f): f for f in files}
    constants = {_module_name(f): _module_constants(t) for f, t in trees.items()}
    found: dict[str, set[str]] = {}
    for f, tree in trees.items():
        _scan_module(f, tree, constants, modules, found)
    # names set through a module-level mapping of settings (hostcpu's FORCED_CPU_SETTINGS, applied by setenv)
    for f, tree in trees.items():
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and ("ENV" in t.id or "FORCED" in t.id)
                                                    for t in node.targets):
                for d in ast.walk(node.value):
                    if isinstance(d, ast.Dict):
                        for k in d.keys:
                            if isinstance(k, ast.Constant) and isinstance(k.value, str) and NAME.match(k.value):
                                found.setdefault(k.value, set()).add(_module_name(f))
    return found


def environment_problems(found: dict[str, set[str]] | None = None) -> list[str]:
    """Names the code reads or sets without words in :data:`ENVIRONMENT`: each is a row the table would miss."""
    found = scan_environment() if found is None else found
    out = [f"{n}: read or set in {', '.join(sorted(found[n]))}, not described in doctables/reference.py"
           for n in sorted(set(found) - set(ENVIRONMENT))]
    return out


def unused_descriptions(found: dict[str, set[str]] | None = None) -> list[str]:
    """Names with words in :data:`ENVIRONMENT` that the code does not use (not rows of the table)."""
    found = scan_environment() if found is None else found
    return sorted(set(ENVIRONMENT) - set(found))


def _cell(text: str) -> str:
    """A table cell: ``|`` escaped; ``<``/``>`` escaped outside code spans (inside one GitHub shows them as typed)."""
    parts = str(text).replace("|", "\\|").replace("\n", " ").split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;").replace(">", "&gt;") for i, p in enumerate(parts))


def _default(d: object) -> str:
    if d in (None, "", False) or d is argparse.SUPPRESS:
        return "off" if d is False else "-"
    return f"{d:g}" if isinstance(d, float) else str(d)


def option_rows() -> Iterator[tuple[str, str, str, str]]:
    from doctables.options import plugin_options

    for o in plugin_options():
        flag = o["flag"] + ("={" + ",".join(o["choices"]) + "}" if o["choices"] else "")
        yield f"`{flag}`", f"pytest (ini `{o['dest']}`)", _default(o["default"]), o["help"]


def cli_rows() -> Iterator[tuple[str, str, str, str]]:
    from pytest_rlhfmem.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    for name, parser in sub.choices.items():
        for a in parser._actions:
            if not a.option_strings or isinstance(a, argparse._HelpAction):
                continue
            flag = ", ".join(a.option_strings)
            if a.choices:
                flag += "={" + ",".join(map(str, a.choices)) + "}"
            elif a.metavar and a.nargs != 0:
                flag += f" {a.metavar}"
            help_text = (a.help or "").replace("%%", "%") if a.help is not argparse.SUPPRESS else "-"
            yield f"`{flag}`", f"`rlhfmem {name}`", _default(a.default), help_text


def environment_rows(found: dict[str, set[str]] | None = None) -> Iterator[tuple[str, str, str, str]]:
    found = scan_environment() if found is None else found
    problems = environment_problems(found)
    if problems:
        raise SystemExit("doctables.reference: " + "; ".join(problems))
    order = list(KINDS)
    for name in sorted(found, key=lambda n: (order.index(ENVIRONMENT[n][0]), n)):
        kind, meaning = ENVIRONMENT[name]
        where = ", ".join(sorted(m.removeprefix("pytest_rlhfmem.") for m in found[name]))
        yield f"`${name}{'*' if name.endswith('_') else ''}`", KINDS[kind], "-", f"{meaning} (in: {where})"


def table(found: dict[str, set[str]] | None = None) -> list[str]:
    rows = ["| name | what | default | meaning |", "|---|---|---|---|"]
    for row in (*option_rows(), *cli_rows(), *environment_rows(found)):
        rows.append("| " + " | ".join(_cell(c) for c in row) + " |")
    return rows


def main(argv: list[str]) -> int:
    if argv:
        print("usage: python -m doctables.reference", file=sys.stderr)
        return 2
    print("\n".join(table()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
