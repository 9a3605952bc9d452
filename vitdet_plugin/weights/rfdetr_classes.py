"""The classes of an RF-DETR checkpoint's classifier, as rfdetr 1.11.2 reads them.

rfdetr sizes its class head for ``num_classes=K`` with ``K + 1`` logits and records the
dataset's class names in the file's ``args`` (``args.class_names``, a namespace attribute or
a dict entry). Its ``predict`` names the logits two ways (``detr.py``):

* **COCO files** (91 logits, ``args.num_classes=90``, no class names or the 80 COCO ones):
  logit ``i`` is COCO category id ``i`` (1..90 with gaps); mmdet's 80 COCO classes are the
  rows :data:`COCO_CATEGORY_IDS`;
* **fine-tuned files** (``K + 1`` logits): logit ``k < K`` is ``class_names[k]`` (the dataset's
  categories sorted by id) and logit ``K`` is the no-object slot; a head of the checkpoint's
  own ``K`` classes takes the rows ``0 .. K-1``.

Fine-tuning from a file on ``K`` classes of your own, rfdetr's ``load_pretrain_weights`` loads
the classifier and then ``reinitialize_detection_head(K + 1)`` tiles (or truncates) its rows:
row ``i`` is the checkpoint's row ``i mod C``. A head of ``K`` classes takes those rows without
the last (:func:`finetune_rows`). Pure functions of tensors and names.
"""
import re
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

#: mmdet's 80 COCO classes (``CocoDataset.METAINFO['classes']``, in this order) as the COCO
#: category ids (1..90 with gaps) that index RF-DETR's 91 COCO logits.
COCO_CATEGORY_IDS: Tuple[int, ...] = (
    1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 27,
    28, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 46, 47, 48, 49, 50, 51, 52, 53,
    54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64, 65, 67, 70, 72, 73, 74, 75, 76, 77, 78, 79, 80,
    81, 82, 84, 85, 86, 87, 88, 89, 90)
#: RF-DETR's COCO classifier: ``num_classes=90`` plus one logit, indexed by category id.
COCO_LOGITS = 91
#: transformers' ``model_type`` of ``RfDetrForObjectDetection`` / ``RfDetrForInstanceSegmentation``.
TRANSFORMERS_RFDETR = 'rf_detr'
#: How many names the class list of a file shows in a message before '...'.
SHOWN_NAMES = 10
#: The classifier rows of our head (every layer's shared branch, each group's proposals'), in
#: the head's own names and in our detector's.
CLASS_ROWS = re.compile(r'^(bbox_head\.)?(cls_branch|enc_cls_branches\.\d+)\.(weight|bias)$')


class FileClasses(NamedTuple):
    """What an RF-DETR file's classifier holds: its logits, rfdetr's class names (None when
    the file records none) and whether it is a COCO file (logits indexed by category id)."""
    logits: int
    names: Optional[Tuple[str, ...]]
    coco: bool

    @property
    def own(self) -> int:
        """The classes of a head that takes the file's own classes: mmdet's 80 COCO ones, or
        rfdetr's ``num_classes`` (the logits without the no-object slot)."""
        return len(COCO_CATEGORY_IDS) if self.coco else self.logits - 1

    def describe(self) -> str:
        """``91 logits: COCO ...`` / ``4 logits: rfdetr's num_classes=3 ('a', 'b', 'c') ...``."""
        if self.coco:
            return (f"{self.logits} logits, rfdetr's COCO classifier (COCO category ids; "
                    f"mmdet's {self.own} COCO classes)")
        return (f"{self.logits} logits, rfdetr's num_classes={self.own}{show_names(self.names)} "
                'plus its no-object slot')


def show_names(names: Optional[Sequence[str]]) -> str:
    """`` ('a', 'b', ...)`` for a message, or '' when there are none."""
    if not names:
        return ''
    shown = ', '.join(repr(n) for n in names[:SHOWN_NAMES])
    return f" ({shown}{', ...' if len(names) > SHOWN_NAMES else ''})"


def args_class_names(args: Any) -> Optional[Tuple[str, ...]]:
    """``class_names`` of an RF-DETR file's ``args`` (a namespace or a dict), or None."""
    names = args.get('class_names') if isinstance(args, Mapping) else getattr(
        args, 'class_names', None)
    if isinstance(names, (list, tuple)) and names and all(isinstance(n, str) for n in names):
        return tuple(names)
    return None


def transformers_labels(config: Optional[Mapping[str, Any]]) -> Optional[Tuple[str, ...]]:
    """The class names of a transformers RF-DETR folder's ``config.json`` (``id2label`` in
    logit order: its ``num_labels`` logits are each a class, no no-object slot), or None when
    ``config`` is not one."""
    if not config or config.get('model_type') != TRANSFORMERS_RFDETR:
        return None
    labels = config.get('id2label') or {}
    return tuple(labels[k] for k in sorted(labels, key=int))


def file_classes(logits: int, names: Optional[Sequence[str]]) -> FileClasses:
    """The classes of a classifier of ``logits`` rows with rfdetr's ``names``: a COCO file
    when it has 91 logits and no names of its own (rfdetr's ``predict`` rule)."""
    names = tuple(names) if names else None
    coco = logits == COCO_LOGITS and (names is None or len(names) == len(COCO_CATEGORY_IDS))
    return FileClasses(logits, names, coco)


def own_rows(classes: FileClasses) -> List[int]:
    """The classifier rows of the file's own classes (rfdetr's ``predict`` label space)."""
    return list(COCO_CATEGORY_IDS) if classes.coco else list(range(classes.own))


def finetune_rows(logits: int, num_classes: int) -> List[int]:
    """The rows a head of ``num_classes`` starts from when fine-tuned from a classifier of
    ``logits`` rows: rfdetr's ``reinitialize_detection_head(num_classes + 1)`` after loading
    (row ``i`` is row ``i mod logits``), its no-object slot (the last row) dropped."""
    return [i % logits for i in range(num_classes)]


def select_rows(state: Mapping[str, Tensor], rows: Sequence[int]) -> Dict[str, Tensor]:
    """``state`` with every classifier entry (:data:`CLASS_ROWS`) cut to ``rows``."""
    index = torch.tensor(list(rows), dtype=torch.long)
    return {k: v.index_select(0, index) if CLASS_ROWS.match(k) else v for k, v in state.items()}


def class_entries(state: Mapping[str, Tensor]) -> Dict[str, Tensor]:
    """The classifier entries (:data:`CLASS_ROWS`) of ``state``."""
    return {k: v for k, v in state.items() if CLASS_ROWS.match(k)}
