"""vitdet_plugin: Swin and plain-ViT (ViTDet) backbones for MMDetection 3.x."""
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

HERE = Path(__file__).parent
version: dict = {}
exec((HERE / 'vitdet_plugin' / 'version.py').read_text(), version)

#: Installed next to the package in site-packages: at interpreter start it loads
#: vitdet_plugin/ops/startup.py by path (standard library only; the package itself is not
#: imported) so that `import mmcv._ext` finds the compile-free ops before anything imports
#: mmcv.ops (mmdet's tools, `mim train`, `import mmdet.models`). VITDET_MMCV_OPS=off disables it.
OPS_PTH = 'vitdet_plugin-mmcv-ops.pth'
OPS_PTH_LINE = (
    "import importlib.util as _u, os as _o; "
    "_s = _u.find_spec('vitdet_plugin'); "
    "_d = _s and _s.submodule_search_locations and list(_s.submodule_search_locations)[0]; "
    "_f = _d and _o.path.join(_d, 'ops', 'startup.py'); "
    "_p = _f and _o.path.isfile(_f) and _u.spec_from_file_location('_vitdet_plugin_ops_startup', _f); "
    "_m = _p and _u.module_from_spec(_p); "
    "_p and _p.loader.exec_module(_m); "
    "_m and _m.install()\n")


class BuildPyWithOpsHook(build_py):
    """build_py that also writes the .pth hook at the root of the build (site-packages)."""

    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / OPS_PTH
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(OPS_PTH_LINE)

    def get_outputs(self, include_bytecode: bool = True) -> list:
        return super().get_outputs(include_bytecode) + [str(Path(self.build_lib) / OPS_PTH)]


class EditableWheelWithOpsHook(editable_wheel):
    """editable_wheel that adds the .pth hook to the editable wheel (setuptools' editable
    wheels hold only their own .pth and finder, not what build_py wrote)."""

    def run(self) -> None:
        super().run()
        for wheel in Path(self.dist_dir).glob('*.editable-*.whl'):
            add_to_wheel(wheel, OPS_PTH, OPS_PTH_LINE.encode())


def add_to_wheel(wheel: Path, name: str, data: bytes) -> None:
    """Add a file at the root of ``wheel`` and list it in the wheel's RECORD."""
    import base64
    import hashlib
    import zipfile

    with zipfile.ZipFile(wheel) as zf:
        entries = [(info, zf.read(info)) for info in zf.infolist()]
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()
    with zipfile.ZipFile(wheel, 'w', zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(name, data)
        for info, content in entries:
            if info.filename.endswith('.dist-info/RECORD'):
                content += f'{name},sha256={digest},{len(data)}\n'.encode()
            if info.filename != name:
                zf.writestr(info, content)

setup(
    name='vitdet_plugin',
    version=version['__version__'],
    description='Faithful, fast Swin Transformer and ViTDet backbones (and a DETR-style head) '
                'for MMDetection 3.x',
    long_description=(HERE / 'README.md').read_text(),
    long_description_content_type='text/markdown',
    license='Apache-2.0',
    python_requires='>=3.9',
    packages=find_packages(include=['vitdet_plugin', 'vitdet_plugin.*']),
    include_package_data=True,
    cmdclass={'build_py': BuildPyWithOpsHook, 'editable_wheel': EditableWheelWithOpsHook},
    # mmcv>=2.0.0rc4,<2.2.0 is required too, as either distribution: `mmcv-lite` (the `lite`
    # extra; the plugin's compile-free ops stand in for its compiled extension) or `mmcv` built
    # with ops (`make env MMCV=compiled`). Both install the `mmcv` package, so neither is listed.
    install_requires=[
        'torch>=2.4',  # torch.serialization.add_safe_globals (weights_only resume)
        'torchvision',
        'mmengine==0.10.7',
        'mmdet==3.3.0',
        'numpy',
        'pycocotools',
        'tqdm',
        'matplotlib',  # tools/analysis/visualize.py (PNG pictures)
        # mmengine resolves `mmdet::` base configs through pkg_resources (gone in setuptools 81)
        'setuptools<81',
    ],
    extras_require={
        # pip install vitdet_plugin[lite]: mmcv's Python code, ops from vitdet_plugin.ops
        'lite': ['mmcv-lite==2.1.0'],
        # `make lint` pins its checkers: a new release may flag code that passed.
        # The tests (and mmdet's CocoPanopticDataset / CocoPanopticMetric) also need
        # panopticapi: `make env` installs panopticapi-lite with --no-deps (tools/env/setup_env.sh),
        # as its numpy<2 pin would make pip downgrade numpy, opencv-python and ml_dtypes here;
        # elsewhere: pip install --no-deps panopticapi-lite==0.2.0
        # transformers 5: the parity tests of its checkpoint layouts (save_pretrained folders;
        # its 5.x names, tests/weights/test_checkpoint_transformers.py)
        # rfdetr (pinned: the RF-DETR parity reference, tests/models/*/test_rfdetr* and
        # test_lwdetr*; it adds supervision, av, pyDeprecate and requests); its [train] extra:
        # its Lightning trainer, the reference of tests/engine/test_rfdetr_trainer_parity.py
        # (pytorch-lightning 2.6, torchmetrics 1.8, faster-coco-eval, roboflow: typer < 0.26)
        'tests': ['pytest>=7', 'pytest-xdist>=3.5', 'timm>=1.0.9', 'transformers>=5,<6',
                  'rfdetr[train]==1.11.2', 'ruff==0.17.6', 'mypy==2.4.1'],
        # tools/export_onnx.py: torch's dynamo ONNX exporter (onnxscript) and the check
        'deploy': ['onnx>=1.16', 'onnxscript>=0.3', 'onnxruntime>=1.18'],
    },
    classifiers=[
        'Programming Language :: Python :: 3',
        'Topic :: Scientific/Engineering :: Artificial Intelligence',
    ],
)
