# vitdet_plugin developer commands. See README.md.
# openmmlab: mmdet 3.3.0, mmengine 0.10.7, mmcv 2.1.0 in .venv (default);
# onedl: the maintained fork (onedl-mmdetection, onedl-mmengine, onedl-mmcv) in .venv-onedl
STACK ?= openmmlab
VENV := $(if $(filter onedl,$(STACK)),.venv-onedl,.venv)
PY := $(VENV)/bin/python
# lite: mmcv-lite + the plugin's compile-free ops (default, wheels only, minutes);
# compiled: mmcv 2.1.0 built with ops from its sdist (g++, Python headers, 20-40 min)
MMCV ?= lite

.PHONY: env lint test test-all smoke demo demo-seg demo-detr demo-rfdetr demo-rfdetr-seg demo-deimv2 benchmark clean-env gpu-wheels

env:            ## build .venv: torch 2.14.1, mmcv-lite 2.1.0 (MMCV=compiled: with ops), mmdet 3.3.0, plugin (STACK=onedl: .venv-onedl, the fork)
	MMCV=$(MMCV) STACK=$(STACK) bash tools/env/setup_env.sh

lint: env       ## ruff (package, tools, tests, configs) + mypy (package, tools); ruff.toml, mypy.ini
	$(PY) -m ruff check vitdet_plugin tools tests configs
	$(PY) -m mypy vitdet_plugin tools

# the default suite runs in TEST_JOBS processes (pytest-xdist), a test file per process at a time,
# each on its share of the cores (tests/conftest.py sets the thread counts); it ends with its
# slowest files; .ci/run holds it to a time budget
TEST_JOBS ?= 2
test: env       ## the default (fast) test suite
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile

test-all: env   ## every test, slow ones included
	$(PY) -m pytest -q -m "slow or not slow"

# The stack smoke subset (.ci/run runs it on STACK=onedl): import, registry and the version gate;
# one training step and inference of the demo Swin RetinaNet and Mask R-CNN, and of mmdet's own
# Swin configs with our backbone; mmdet's tools/train.py and init_detector through the ops hook;
# the checkpoint-loading tests. README.md "Stacks" says what else runs on the fork.
SMOKE_TESTS := \
	tests/test_foundation.py \
	'tests/configs/test_configs.py::test_config_trains_and_predicts[demo/swin_retinanet_shapes.py]' \
	'tests/configs/test_configs.py::test_config_trains_and_predicts[demo/swin_mask_rcnn_shapes.py]' \
	tests/configs/test_configs.py::test_stock_mmdet_config_with_our_backbone \
	tests/ops/test_ops_entry_points.py \
	tests/weights/test_checkpoint_arch.py \
	tests/weights/test_checkpoint_families.py \
	tests/weights/test_swin_weights.py \
	tests/weights/test_vit_weights.py \
	tests/weights/test_vit_weights_detectron2.py \
	tests/weights/test_official_vit_layouts.py \
	tests/weights/test_vit_family_loading.py
smoke: env      ## the stack smoke subset (SMOKE_TESTS) on STACK's venv
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile $(SMOKE_TESTS)

demo: env       ## generate the shapes dataset, train + evaluate the demo Swin RetinaNet on CPU
	bash tools/demo.sh

demo-seg: env   ## the same for segmentation: Panoptic FPN on the stem Swin (segm mAP, PQ, mIoU)
	DEMO_CONFIG=$${DEMO_CONFIG:-configs/demo/swin_panoptic_fpn_shapes.py} \
	DEMO_WORK_DIR=$${DEMO_WORK_DIR:-work_dirs/demo_seg} bash tools/demo.sh

demo-detr: env  ## after make demo: a DETR-style head on its (frozen) backbone and neck, trained + evaluated
	DEMO_CONFIG=$${DEMO_CONFIG:-configs/demo/swin_detr_pretrained_shapes.py} \
	DEMO_WORK_DIR=$${DEMO_WORK_DIR:-work_dirs/demo_detr} \
	DEMO_PRETRAINED=$${DEMO_PRETRAINED:-work_dirs/demo_swin_retinanet} bash tools/demo.sh

demo-rfdetr: env  ## RF-DETR (windowed DINOv2, projector, LW-DETR head) from scratch on the shapes set
	DEMO_CONFIG=$${DEMO_CONFIG:-configs/demo/rfdetr_shapes.py} \
	DEMO_WORK_DIR=$${DEMO_WORK_DIR:-work_dirs/demo_rfdetr} bash tools/demo.sh

demo-rfdetr-seg: env  ## RF-DETR-Seg (the same with RF-DETR's mask branch): bbox and segm mAP
	DEMO_CONFIG=$${DEMO_CONFIG:-configs/demo/rfdetr_seg_shapes.py} \
	DEMO_WORK_DIR=$${DEMO_WORK_DIR:-work_dirs/demo_rfdetr_seg} bash tools/demo.sh

demo-deimv2: env  ## DEIMv2 (DINOv3 + STA, hybrid encoder, D-FINE decoder) from scratch on the shapes set
	DEMO_CONFIG=$${DEMO_CONFIG:-configs/demo/deimv2_shapes.py} \
	DEMO_WORK_DIR=$${DEMO_WORK_DIR:-work_dirs/demo_deimv2} bash tools/demo.sh

benchmark: env  ## ours vs mmdet vs timm, printed as ratios
	$(PY) tools/benchmark.py

gpu-wheels:     ## .whl/: the wheels (CPython 3.12, ~7 MiB; nothing is built there) tools/dev/gpu_check.sh installs on a GPU machine
	bash tools/dev/gpu_wheels.sh

clean-env:
	rm -rf $(VENV)
