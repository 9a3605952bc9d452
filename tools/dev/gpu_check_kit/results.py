"""Where the GPU check keeps what it found, written after every check, row and step.

Each writer (the orchestrator's step list, a check group, a benchmark) owns one *part*, a
JSON file in the results folder (``<work>/results``), rewritten atomically whenever it learns
something. :func:`publish` then merges every part into the output folder (``$OUT``) as two
files, ``gpu_check.json`` and ``gpu_check.md`` (beside the orchestrator's ``gpu_check.log``):
the device tool returns at most 8 files from ``$OUT``, and whatever is there when a run is cut
short still comes back. Standard library only (the orchestrator runs before anything is
installed).
"""
import json
import os
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

#: Files of the output folder: merged results, the report, the whole run's log.
JSON_NAME = 'gpu_check.json'
REPORT_NAME = 'gpu_check.md'
LOG_NAME = 'gpu_check.log'
#: Part names: the step list, the device and torch stack, the OpenMMLab stack; check groups
#: and benchmarks are ``checks-<group>`` and ``bench-<name>``.
STEPS_PART = 'steps'
ENVIRONMENT_PART = 'environment'
STACK_PART = 'stack'
CHECKS_PREFIX = 'checks-'
BENCH_PREFIX = 'bench-'
#: A failing check's detail: its error's first line, at most this long.
MAX_DETAIL_CHARS = 300


@dataclass
class Result:
    """One functional check: passed or not, what it measured (or its error), how long."""

    name: str
    ok: bool
    detail: str
    seconds: float


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` to ``path`` atomically (a reader sees the old or the new file)."""
    write_text(path, json.dumps(data, indent=1, default=str) + '\n')


def write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f'.{path.name}.tmp')
    tmp.write_text(text)
    os.replace(tmp, path)


def write_part(results: Path, name: str, data: Any) -> None:
    write_json(results / f'{name}.json', data)


def read_parts(results: Path) -> Dict[str, Any]:
    """Every part in ``results`` by name (a part that cannot be read is reported as such)."""
    parts: Dict[str, Any] = {}
    for path in sorted(results.glob('*.json')) if results.is_dir() else []:
        try:
            parts[path.stem] = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            parts[path.stem] = {'unreadable': f'{type(e).__name__}: {e}'}
    return parts


def merge(parts: Dict[str, Any]) -> Dict[str, Any]:
    """The parts as one document: environment, stack, steps, checks by group, benchmarks."""
    return {
        'environment': parts.get(ENVIRONMENT_PART),
        'stack': parts.get(STACK_PART),
        'steps': parts.get(STEPS_PART, []),
        'checks': {k[len(CHECKS_PREFIX):]: v for k, v in parts.items()
                   if k.startswith(CHECKS_PREFIX)},
        'benchmarks': {k[len(BENCH_PREFIX):]: v for k, v in parts.items()
                       if k.startswith(BENCH_PREFIX)},
    }


def publish(results: Path, out: Optional[Path]) -> Dict[str, Any]:
    """Merge the parts into ``out``'s gpu_check.json and gpu_check.md (when ``out`` is set)."""
    from .report import render
    data = merge(read_parts(results))
    if out is not None:
        write_json(out / JSON_NAME, data)
        write_text(out / REPORT_NAME, render(data))
    return data


def error_line(e: BaseException) -> str:
    return f'{type(e).__name__}: {e}'.strip().splitlines()[0][:MAX_DETAIL_CHARS]


def run_checks(checks: Sequence[Tuple[str, Callable[[], str]]],
               record: Callable[[List[Result]], None]) -> List[Result]:
    """Run each check in turn; one that raises (a parity miss is an ``AssertionError``) is
    recorded as failed with its error and the others still run. ``record`` gets the results
    so far after every check."""
    results: List[Result] = []
    for name, fn in checks:
        start = time.perf_counter()
        try:
            detail, ok = fn(), True
        except Exception as e:  # recorded; the other checks still run
            traceback.print_exc()
            detail, ok = error_line(e), False
        results.append(Result(name, ok, detail, round(time.perf_counter() - start, 2)))
        print(f"[gpu_check] {'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
        record(results)
    return results


def results_json(results: Sequence[Result]) -> List[Dict[str, Any]]:
    return [asdict(r) for r in results]
