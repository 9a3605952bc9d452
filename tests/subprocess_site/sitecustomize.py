"""Run at the start of every Python process the tests start (tests/conftest.py puts this folder
on PYTHONPATH, ``helpers.subprocess_env`` keeps it there): ``transformers`` reads as not
installed, as in an install without the tests extra.

mmengine (its Adafactor optimizer) and mmdet (GLIP's BERT text transforms) import transformers
at start-up whenever it is installed: about 1.7 s of every tools/train.py or torchrun worker on
2 cores (measured 2026-12-03: tests/engine/test_reproducible.py + test_crash_resume.py, ten
processes, 122 s -> 106 s). transformers is a test reference of ours (tests/weights/, in the
pytest process), not a dependency, and no process a test starts uses it."""
import sys

sys.modules.setdefault('transformers', None)  # `import transformers` raises ImportError
