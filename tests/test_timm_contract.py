"""timm's own model tests (pytorch-image-models' tests/test_models.py, from the sdist of the timm installed) run on vitpe's
registered models: the contract timm's fine-tuning tools read (num_features, get/reset_classifier, forward_head's
pre_logits, pretrained_cfg, group_matcher, no_weight_decay, set_grad_checkpointing), forward, backward and features.
vitpe's ViTs are checked as timm checks its own ViTs (its NON_STD_FILTERS: token outputs, not NCHW maps). TorchScript
and torch.fx are left out: docs/timm.md says why."""
import subprocess
import sys
import tarfile

import pytest
import timm

MODELS = ["vitpe_vit", "vitpe_cifar_patch4_32", "vitpe_cifar_patch4_32_rope_mixed", "vitpe_cifar_patch4_32_rel_bias",
          "vitpe_cifar_patch4_32_learned", "vitpe_cifar_patch4_32_peg"]


@pytest.fixture(scope="module")
def timm_tests(tmp_path_factory):
    where = tmp_path_factory.mktemp("timm-sdist")
    r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", f"timm=={timm.__version__}",
                        "-d", str(where)], capture_output=True, text=True, timeout=300)
    archives = list(where.glob("timm-*.tar.gz"))
    if r.returncode or not archives:
        pytest.skip(f"timm {timm.__version__}'s sdist could not be fetched from PyPI ({r.stderr.strip()[-200:]})")
    with tarfile.open(archives[0]) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("/tests/test_models.py"))
        text = tar.extractfile(member).read().decode()
    marker = "NON_STD_FILTERS = ["
    assert marker in text, "timm's test file no longer lists its non-standard models: read it again"
    head = "import vitpe  # registers vitpe_* in timm's factory\n"
    (where / "test_models.py").write_text(head + text)  # as timm ships it: forward_features is tested on standard models
    (where / "test_models_vit.py").write_text(head + text.replace(marker, marker + "'vitpe_*', ", 1))  # ... the rest as for its ViTs
    return where


def run_timm(folder, file, select):
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore", file, "-k", select],
                       cwd=folder, capture_output=True, text=True, timeout=900)
    tail = r.stdout.strip().splitlines()[-1]
    assert r.returncode == 0 and " failed" not in tail, r.stdout[-3000:]
    return int(tail.split(" passed")[0].split()[-1])


def test_timms_model_tests_pass_on_vitpe_models(timm_tests):
    models = " or ".join(f"[{b}-{m}]" for m in MODELS for b in (1, 2))
    # default_cfgs (timm's model contract), forward and backward, as timm tests its ViTs
    assert run_timm(timm_tests, "test_models_vit.py", f"({models}) and (default_cfgs or test_model_forward or test_model_backward) "
                    "and not torchscript and not fx") == 3 * len(MODELS)
    assert run_timm(timm_tests, "test_models.py", f"({models}) and test_model_forward_features") == len(MODELS)
