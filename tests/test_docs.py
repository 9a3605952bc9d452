"""README.md and docs/*.md cannot go stale silently (issue 38).

Every relative link and ``#anchor`` resolves (GitHub's heading slugs); every ``tools/...`` file
named exists and every Python tool named answers ``--help`` (all in one interpreter); every
``configs/...`` file named exists and loads with ``Config.fromfile``; every ``make`` target named
is a target of the Makefile; the README's channels-per-arch table matches the backbones'
declared outputs. The checker itself is tested on a temporary doc with broken links.
"""
import glob
import json
import os.path as osp
import re
import subprocess
import sys
from typing import Dict, Iterator, List, Sequence, Set, Tuple

import pytest

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
FENCE = re.compile(r'^(```|~~~)')
LINK = re.compile(r'!?\[[^\]]*\]\(([^)\s]+)\)')
INLINE_CODE = re.compile(r'`([^`]+)`')
TOOL = re.compile(r'(?<![\w/.-])tools/[\w/.-]+\.(?:py|sh|txt)')
CONFIG = re.compile(r'(?<![\w/.:-])configs/[\w/.-]+\.py')
MAKE = re.compile(r'(?:^|[\s;&(])make ([a-z][\w-]*)')
MAKE_TARGET = re.compile(r'^([a-zA-Z][\w-]*):', re.M)
#: seconds for all the ``--help`` calls together
HELP_TIMEOUT_S = 300


def doc_files(root: str = ROOT) -> List[str]:
    return [osp.join(root, 'README.md')] + sorted(glob.glob(osp.join(root, 'docs', '*.md')))


def split_code(text: str) -> Tuple[List[str], List[str]]:
    """(prose lines, code-block lines) of a markdown text."""
    prose, code, fenced = [], [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        (code if fenced else prose).append(line)
    return prose, code


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r'[`*_]|\[([^\]]*)\]\([^)]*\)', r'\1', heading.strip().lower())
    return re.sub(r'[^\w\- ]', '', text).replace(' ', '-')


def anchors(path: str) -> Set[str]:
    prose, _ = split_code(open(path).read())
    seen: Dict[str, int] = {}
    out = set()
    for line in prose:
        m = re.match(r'^#{1,6}\s+(.*)$', line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f'{base}-{n}')
    return out


def link_problems(files: Sequence[str]) -> List[str]:
    """``file: link: why`` for every relative link whose file or anchor does not exist."""
    problems = []
    for path in files:
        prose, _ = split_code(open(path).read())
        for target in LINK.findall('\n'.join(INLINE_CODE.sub('', ln) for ln in prose)):
            if re.match(r'^[a-z][\w+.-]*:', target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition('#')
            dest = osp.normpath(osp.join(osp.dirname(path), file_part)) if file_part else path
            if not osp.exists(dest):
                problems.append(f'{osp.basename(path)}: {target}: no such file')
            elif anchor and (not dest.endswith('.md') or anchor not in anchors(dest)):
                problems.append(f'{osp.basename(path)}: {target}: no heading #{anchor} in '
                                f'{osp.basename(dest)}')
    return problems


def code_spans(path: str) -> Iterator[str]:
    """Inline code and code-block lines of a markdown file: where commands are written."""
    prose, code = split_code(open(path).read())
    yield from code
    for line in prose:
        yield from INLINE_CODE.findall(line)


def named(pattern: re.Pattern, files: Sequence[str], everywhere: bool = True) -> Set[str]:
    """Every match of ``pattern`` in ``files`` (whole text, or only code when not
    ``everywhere``); names with a wildcard or placeholder are left out."""
    found: Set[str] = set()
    for path in files:
        texts = [open(path).read()] if everywhere else list(code_spans(path))
        for text in texts:
            for m in pattern.finditer(text):
                name = m.group(1) if pattern.groups else m.group(0)
                if not re.search(r'[*<>{}]|\.\.\.', name):
                    found.add(name)
    return found


def makefile_targets() -> Set[str]:
    return set(MAKE_TARGET.findall(open(osp.join(ROOT, 'Makefile')).read()))


def _is_entry_point(path: str) -> bool:
    text = open(osp.join(ROOT, path)).read()
    return "__name__ == '__main__'" in text and 'argparse' in text


# ----------------------------------------------------------------------------- the docs
def test_docs_exist_and_readme_is_short():
    assert len(open(osp.join(ROOT, 'README.md')).read().splitlines()) <= 250
    assert len(doc_files()) > 10


def test_every_relative_link_and_anchor_resolves():
    problems = link_problems(doc_files())
    assert problems == [], 'broken links:\n' + '\n'.join(problems)


def test_every_tool_named_exists():
    tools = named(TOOL, doc_files())
    assert 'tools/train.py' in tools
    assert sorted(t for t in tools if not osp.isfile(osp.join(ROOT, t))) == []


def test_every_python_tool_named_answers_help():
    """All ``--help`` calls in one interpreter (imports paid once): each must exit 0 and print
    its usage."""
    tools = sorted(t for t in named(TOOL, doc_files())
                   if t.endswith('.py') and osp.isfile(osp.join(ROOT, t)) and _is_entry_point(t))
    script = (
        'import contextlib, io, json, os, runpy, sys\n'
        'out = {}\n'
        'for tool in sys.argv[1:]:\n'
        '    sys.argv = [tool, "--help"]\n'
        '    sys.path.insert(0, os.path.dirname(os.path.abspath(tool)))  # as python TOOL does\n'
        '    buf = io.StringIO()\n'
        '    code = "no exit"\n'
        '    try:\n'
        '        with contextlib.redirect_stdout(buf):\n'
        '            runpy.run_path(tool, run_name="__main__")\n'
        '    except SystemExit as e:\n'
        '        code = e.code\n'
        '    except BaseException as e:\n'
        '        code = f"{type(e).__name__}: {e}"\n'
        '    out[tool] = [code, "usage:" in buf.getvalue()]\n'
        '    sys.path.pop(0)\n'
        'print("RESULT " + json.dumps(out))\n')
    done = subprocess.run([sys.executable, '-c', script, *tools], cwd=ROOT, capture_output=True,
                          text=True, timeout=HELP_TIMEOUT_S)
    line = [ln for ln in done.stdout.splitlines() if ln.startswith('RESULT ')]
    assert line, done.stderr[-3000:]
    results = json.loads(line[-1][len('RESULT '):])
    assert len(tools) >= 5
    assert {t: r for t, r in results.items() if r not in ([0, True], [None, True])} == {}


def test_every_config_named_exists_and_loads():
    from mmengine.config import Config
    configs = sorted(named(CONFIG, doc_files()))
    assert 'configs/swin_retinanet.py' in configs
    assert sorted(c for c in configs if not osp.isfile(osp.join(ROOT, c))) == []
    for c in configs:
        Config.fromfile(osp.join(ROOT, c))


def test_every_make_target_named_exists():
    wanted = named(MAKE, doc_files(), everywhere=False)
    assert {'env', 'demo', 'test'} <= wanted
    assert sorted(wanted - makefile_targets()) == []


# ----------------------------------------------------------------------------- README facts
def _channel_rows() -> List[Tuple[List[str], str, List[int]]]:
    text = open(osp.join(ROOT, 'README.md')).read()
    table = text[text.index('| backbone | arch | `neck.in_channels`'):].split('\n\n')[0]
    rows = []
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip('|').split('|')]
        types = re.findall(r'`(\w+)`', cells[0])
        for arch in cells[1].split(', '):
            rows.append((types, arch, json.loads(cells[2])))
    return rows


def test_readme_channels_table_matches_the_backbones():
    """The neck ``in_channels`` the README tells people to write, per backbone and arch, are
    the channels the backbone declares with ``out_indices=(1, 2, 3)`` (built on meta)."""
    import torch
    from mmdet.registry import MODELS
    from mmengine.registry import init_default_scope

    import vitdet_plugin  # noqa: F401
    init_default_scope('mmdet')
    rows = _channel_rows()
    assert len(rows) == 6  # arch rows; 10 (backbone, arch) pairs
    for types, arch, channels in rows:
        for t in types:
            with torch.device('meta'):
                bb = MODELS.build(dict(type=t, arch=arch, out_indices=(1, 2, 3)))
            assert (t, arch, list(bb.out_channels)) == (t, arch, channels)
            assert list(bb.out_strides) == [8, 16, 32]


def test_readme_plain_vit_widths_match_the_backbones():
    import torch
    from mmdet.registry import MODELS
    from mmengine.registry import init_default_scope

    import vitdet_plugin  # noqa: F401
    init_default_scope('mmdet')
    text = ' '.join(open(osp.join(ROOT, 'README.md')).read().split())
    sentence = text[text.index('width: `ViTBackbone`'):].split('.')[0]
    checked = 0
    for t, body in re.findall(r'`(\w+Backbone)` ([^`]+)', sentence):
        for arch, width in re.findall(r'(\w+) (\d+)', body):
            with torch.device('meta'):
                bb = MODELS.build(dict(type=t, arch=arch))
            assert (t, arch, list(bb.out_channels)) == (t, arch, [int(width)])
            checked += 1
    assert checked == 16


# ----------------------------------------------------------------------------- the checker
def test_the_link_checker_fails_on_broken_links(tmp_path):
    """A doc with a broken file link, a broken anchor and a link inside code (not a link)."""
    (tmp_path / 'docs').mkdir()
    (tmp_path / 'docs' / 'page.md').write_text('# A page\n\n## Real section\n\ntext\n')
    (tmp_path / 'README.md').write_text(
        '# Top\n\n'
        'Good: [page](docs/page.md), [section](docs/page.md#real-section), [top](#top).\n'
        'Broken: [gone](docs/gone.md), [anchor](docs/page.md#no-such-section), '
        '[here](#nowhere).\n\n'
        '```bash\n# not a heading [code](docs/not-a-link.md)\n```\n')
    problems = link_problems(doc_files(str(tmp_path)))
    assert problems == [
        'README.md: docs/gone.md: no such file',
        'README.md: docs/page.md#no-such-section: no heading #no-such-section in page.md',
        'README.md: #nowhere: no heading #nowhere in README.md',
    ]


def test_slugs_follow_github():
    assert slug('Use a backbone in an mmdet config') == 'use-a-backbone-in-an-mmdet-config'
    assert slug('`torch.compile`') == 'torchcompile'
    assert slug('DINOv2, DINOv3 and EVA-02') == 'dinov2-dinov3-and-eva-02'
    assert slug('A 1-minute smoke run') == 'a-1-minute-smoke-run'


@pytest.mark.parametrize('name', ['tools/nothing.py', 'configs/nothing.py'])
def test_missing_names_are_found(tmp_path, name):
    (tmp_path / 'docs').mkdir()
    (tmp_path / 'README.md').write_text(f'Run `python {name}`.\n')
    pattern = TOOL if name.startswith('tools') else CONFIG
    assert named(pattern, doc_files(str(tmp_path))) == {name}
    assert not osp.isfile(osp.join(ROOT, name))
