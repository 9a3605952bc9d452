"""vitdet_plugin: Swin and plain-ViT (ViTDet) backbones for MMDetection 3.x."""
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
version: dict = {}
exec((HERE / 'vitdet_plugin' / 'version.py').read_text(), version)

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
    # mmcv>=2.0.0rc4,<2.2.0 *with compiled ops* is required too; it has no wheel for current
    # torch and is built by `make env` (tools/setup_env.sh), so it is not listed here.
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
        # `make lint` pins its checkers: a new release may flag code that passed.
        # The tests (and mmdet's CocoPanopticDataset / CocoPanopticMetric) also need
        # panopticapi: `make env` installs panopticapi-lite with --no-deps (tools/setup_env.sh),
        # as its numpy<2 pin would make pip downgrade numpy, opencv-python and ml_dtypes here;
        # elsewhere: pip install --no-deps panopticapi-lite==0.2.0
        'tests': ['pytest>=7', 'timm>=1.0.9', 'ruff==0.17.6', 'mypy==2.4.1'],
        # tools/export_onnx.py: torch's dynamo ONNX exporter (onnxscript) and the check
        'deploy': ['onnx>=1.16', 'onnxscript>=0.3', 'onnxruntime>=1.18'],
    },
    classifiers=[
        'Programming Language :: Python :: 3',
        'Topic :: Scientific/Engineering :: Artificial Intelligence',
    ],
)
