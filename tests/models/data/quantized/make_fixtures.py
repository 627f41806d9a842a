"""Write the GPTQ fixtures in this folder with GPTQModel itself (not needed by the tests).

Each fixture is a tiny Llama (tests/tiny_models.py's shape: hidden 64, 2 layers) quantised by
GPTQModel on CPU with a few calibration sentences, saved in GPTQModel's own format, plus
`references/<name>.safetensors`: every quantised layer's weight as GPTQModel dequantises it
(`dequantize_weight()`, [out, in] fp32), the reference tests/models/test_quantized_checkpoints.py
holds treeserve's unpacking to, bit for bit. Run from the repository root, in an environment with
gptqmodel (7.6.0 made these files; it pins other versions than the test environment). GPTQModel
writes AWQ only with CUDA, so the AWQ checkpoint is packed in the test (tests/quantized_files.py):

    python3 -m venv /tmp/venv-gptq && /tmp/venv-gptq/bin/pip install -c constraints.txt torch==2.13.0 gptqmodel
    /work/main/.venv/bin/python -c "from tests.tiny_models import build_checkpoint; build_checkpoint('/tmp/tiny')"
    GPTQMODEL_CPU_WORKERS=2 /tmp/venv-gptq/bin/python tests/models/data/quantized/make_fixtures.py /tmp/tiny
"""

import shutil
import sys
from pathlib import Path

import torch
from gptqmodel import GPTQModel, QuantizeConfig
from safetensors.torch import save_file

HERE = Path(__file__).parent
FIXTURES = {  # name -> QuantizeConfig arguments
    "gptq-4bit-sym": dict(bits=4, group_size=32, desc_act=False, sym=True),
    "gptq-4bit-asym-act-order": dict(bits=4, group_size=32, desc_act=True, sym=False),
    "gptq-8bit-sym": dict(bits=8, group_size=32, desc_act=False, sym=True),
}
TEXTS = [f"the quick brown fox jumps over the lazy dog {i} times, then {i + 1} more words follow" for i in range(64)]


def main(source: str) -> None:
    for name, args in FIXTURES.items():
        if len(sys.argv) > 2 and name not in sys.argv[2:]:
            continue
        out = HERE / name
        shutil.rmtree(out, ignore_errors=True)
        model = GPTQModel.load(source, QuantizeConfig(**args), device="cpu")
        model.quantize(TEXTS, batch_size=4)
        model.save(str(out))
        for junk in ("quant_log.csv", "chat_template.jinja"):
            (out / junk).unlink(missing_ok=True)
        try:  # the fp32 kernel where GPTQModel has one (4-bit), else its bf16 one
            loaded = GPTQModel.load(str(out), device="cpu", dtype=torch.float32)
        except NotImplementedError:
            loaded = GPTQModel.load(str(out), device="cpu", dtype=torch.bfloat16)
        weights = {}
        for module_name, module in loaded.model.named_modules():
            if hasattr(module, "dequantize_weight"):
                weights[module_name] = module.dequantize_weight().float().t().contiguous()
        save_file(weights, str(HERE / "references" / f"{name}.safetensors"))
        print(name, len(weights), "layers")


if __name__ == "__main__":
    main(sys.argv[1])
