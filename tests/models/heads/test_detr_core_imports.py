"""The DETR core under our set-prediction heads: no head reads another head's module (each
stands on ``detr_core`` / ``detr_memory`` / ``set_criterion``), read from the source (the static
import closure of ``tools/dev/reading_set.py``)."""
import pytest
from helpers import REPO_ROOT, load_tool

HEADS = REPO_ROOT / 'vitdet_plugin' / 'models' / 'heads'
#: Each head's own modules: what no other head may import.
OWN = {
    'sdpa_detr_head.py': {'sdpa_detr_head.py', 'multiscale_memory.py', 'transformer.py',
                          'denoising.py'},
    'lwdetr_head.py': {'lwdetr_head.py', 'lwdetr_transformer.py', 'lwdetr_loss.py'},
}
#: The core every head may read.
CORE = {'detr_core.py', 'detr_memory.py', 'set_criterion.py'}


@pytest.mark.parametrize('head,other', [('lwdetr_head.py', 'sdpa_detr_head.py'),
                                        ('lwdetr_seg_head.py', 'sdpa_detr_head.py'),
                                        ('sdpa_detr_head.py', 'lwdetr_head.py')])
def test_no_head_reads_another_heads_modules(head, other):
    tool = load_tool('dev/reading_set.py')
    read = {p.name for p in tool.closure(REPO_ROOT, [HEADS / head], set(tool.DEFAULT_EXCLUDE))
            if p.parent == HEADS}
    assert CORE <= read
    assert not read & OWN[other], sorted(read & OWN[other])
