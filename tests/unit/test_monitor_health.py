"""Each TrainingMonitor heuristic on real training (tiny torch models, CPU, one process): a
fault run that must be named and its healthy twin, which the old heuristics flagged, that must
stay quiet (issue 23 item 4). Also `distdiag analyze` on a run that converged before its first
logged point."""

from __future__ import annotations

import json
import math

import pytest
import torch

from distdiag.monitor import TrainingMonitor
from tests.unit.test_monitor import LogZero


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _warnings(findings, prefix=""):
    return [f.issue for f in findings if f.severity != "info" and f.issue.startswith(prefix)]


# ---------------------------------------------------------------- exactly-zero loss term
class TinyVAE(torch.nn.Module):
    """mu/logvar heads initialised to 0: the posterior equals the prior, KL is exactly 0 at step 0."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = torch.nn.Linear(8, 16)
        self.mu, self.logvar = torch.nn.Linear(16, 4), torch.nn.Linear(16, 4)
        for head in (self.mu, self.logvar):
            torch.nn.init.zeros_(head.weight)
            torch.nn.init.zeros_(head.bias)
        self.dec = torch.nn.Linear(4, 8)

    def forward(self, x):
        h = torch.tanh(self.enc(x))
        mu, logvar = self.mu(h), self.logvar(h)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        recon = (self.dec(z) - x).pow(2).mean()
        kl = 0.5 * (mu.pow(2) + logvar.exp() - 1 - logvar).sum(-1).mean()
        return recon, kl


def _train_vae(frozen_heads: bool):
    torch.manual_seed(0)
    model = TinyVAE()
    if frozen_heads:  # the bug: the encoder's heads left frozen, the KL path is dead for good
        for p in [*model.mu.parameters(), *model.logvar.parameters()]:
            p.requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    mon = TrainingMonitor(model, every=5)
    gen = torch.Generator().manual_seed(1)
    for step in range(40):
        recon, kl = model(torch.randn(32, 8, generator=gen))
        (recon + kl).backward()
        mon.after_backward(recon + kl, step, components={"recon": recon, "kl": kl})
        opt.step()
        opt.zero_grad()
    return mon.close()


def test_kl_zero_at_step_0_only_is_quiet():
    """Healthy VAE: KL exactly 0 before the first update, then it trains: nothing above info."""
    assert _warnings(_train_vae(frozen_heads=False)) == []


def test_kl_zero_for_good_is_a_dead_path():
    """Frozen zero heads: KL stays exactly 0 at every look after step 0: named, from step 5."""
    issues = _warnings(_train_vae(frozen_heads=True), "loss component")
    assert issues == ["loss component 'kl' has been exactly 0 at the 3 looks from step 5 to step 15: a dead path"], issues


# ---------------------------------------------------------------- component dominance
def _train_two_heads(weight_b: float):
    """A shared trunk, head a on a target of scale 30, head b on a target of scale 0.1
    (raw values 10^4-10^5 apart), Adam. weight_b: the weight of b's term in the loss."""
    torch.manual_seed(0)
    trunk, head_a, head_b = torch.nn.Linear(4, 16), torch.nn.Linear(16, 1), torch.nn.Linear(16, 1)
    model = torch.nn.ModuleDict({"trunk": trunk, "a": head_a, "b": head_b})
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    mon = TrainingMonitor(model, every=10)
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(4, 1, generator=gen)
    for step in range(200):
        x = torch.randn(64, 4, generator=gen)
        h = trunk(x)
        a = (head_a(h) - 30 * x @ w).pow(2).mean()
        b = (head_b(h) - 0.1 * torch.sin(x[:, :1])).pow(2).mean()
        (a + weight_b * b).backward()
        mon.after_backward(a + weight_b * b, step, components={"a": a, "b": b})
        opt.step()
        opt.zero_grad()
    return mon.close()


def test_terms_of_different_scales_both_training_are_quiet():
    """Term a is ~10^4x term b in raw value, both train: the old raw-value check warned that a dominates."""
    assert _warnings(_train_two_heads(1.0)) == []


def test_term_that_never_trains_is_reported():
    """b weighted 0: a falls >100x from its start while b does not even halve: reported (info, see
    checks._drowned), with both terms' relative values; b's zero gradient is the warning."""
    findings = _train_two_heads(0.0)
    dom = [f.issue for f in findings if f.issue.startswith("loss component 'a' dominates training")]
    assert len(dom) == 1 and "while 'b' is still" in dom[0], [f.issue for f in findings]
    assert _warnings(findings) == ["gradient norm of b is 0 at step 10, below 1e-08"]


# ---------------------------------------------------------------- gradient-norm imbalance
def _llama(vocab: int, layers: int, hidden: int = 32, inter: int | None = None):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter or 4 * hidden, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def test_llama_training_has_no_imbalance_between_stack_and_norm():
    """A small Llama trained 12 steps: the old check compared model.layers with model.norm (120x at step 0)."""
    model = _llama(vocab=256, layers=4, hidden=128)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = TrainingMonitor(model, every=4)
    gen = torch.Generator().manual_seed(3)
    for step in range(12):
        ids = torch.randint(0, 256, (4, 16), generator=gen)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        mon.after_backward(out.loss, step, logits=out.logits)
        opt.step()
        opt.zero_grad()
    assert _warnings(mon.close(), "gradient norm") == []


def _train_mlp(init_scale: float | None):
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        lin = torch.nn.Linear(16, 16)
        if init_scale is not None:  # the fault: weights initialised far too small
            torch.nn.init.normal_(lin.weight, std=init_scale)
        layers += [lin, torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    mon = TrainingMonitor(model, every=5)
    gen = torch.Generator().manual_seed(4)
    for step in range(10):
        x = torch.randn(32, 16, generator=gen)
        loss = (model(x) - x[:, :1]).pow(2).mean()
        loss.backward()
        mon.after_backward(loss, step)
        opt.step()
        opt.zero_grad()
    return mon.close()


def test_same_kind_layers_with_sound_init_are_quiet():
    assert _warnings(_train_mlp(None), "gradient norms") == []


def test_gradients_vanishing_along_depth_named_between_layers_of_one_kind():
    """Weights of std 0.01: the first Linear's gradient is >100x smaller than the last hidden one's."""
    issues = _warnings(_train_mlp(0.01), "gradient norms")
    weights = [i for i in issues if "(*.weight[16, 16])" in i]
    assert len(weights) == 1 and "x 0.weight" in weights[0], issues


# ---------------------------------------------------------------- architecture table
def test_llama_embedding_share_seen_through_nesting():
    """LlamaForCausalLM (vocab 8000): embed_tokens (under .model) and lm_head hold ~97%: warned, both named."""
    findings = TrainingMonitor(_llama(vocab=8000, layers=2)).close()
    warn = _warnings(findings, "embeddings")
    assert len(warn) == 1 and "model.embed_tokens + lm_head have 512,000 of" in warn[0], warn
    table = next(f.issue for f in findings if f.issue.endswith(")") and "by module" in f.issue)
    assert "model.embed_tokens 256,000" in table and "model.layers (2 x LlamaDecoderLayer)" in table, table


def test_llama_with_small_vocabulary_is_not_warned():
    findings = TrainingMonitor(_llama(vocab=64, layers=4)).close()
    assert _warnings(findings) == []
    table = next(f.issue for f in findings if "by module" in f.issue)
    assert table.split("by module: ")[1].startswith("model.layers (4 x LlamaDecoderLayer)"), table


def test_layer_projection_of_the_tables_shape_is_not_an_embedding():
    """vocab 64 = intermediate 64: each layer's gate/up projection has embed_tokens' shape; only
    embed_tokens and lm_head (get_output_embeddings) count, 18% of the parameters: no warning."""
    findings = TrainingMonitor(_llama(vocab=64, layers=2, hidden=32, inter=64)).close()
    assert _warnings(findings) == []


# ---------------------------------------------------------------- NaN made inside a module
class SafeLog(torch.nn.Module):
    """log(1 + x); `guard` takes |x| first (healthy), else the NaN of x < -1 is replaced by 0."""

    def __init__(self, guard: bool) -> None:
        super().__init__()
        self.guard = guard

    def forward(self, x):
        if self.guard:
            return torch.log1p(x.abs())
        return torch.nan_to_num(torch.log1p(x), nan=0.0)


def _train_log(guard: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), SafeLog(guard), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    mon = TrainingMonitor(model, every=5)  # default trace setting
    gen = torch.Generator().manual_seed(5)
    for step in range(16):
        loss = model(torch.randn(16, 4, generator=gen)).pow(2).mean()
        loss.backward()
        mon.after_backward(loss, step)
        opt.step()
        opt.zero_grad()
    return mon, mon.close()


def test_nan_replaced_inside_a_module_is_named_with_default_settings():
    """log of negative values, nan_to_num'd: the loss stays finite; the look at 0 sees it, step 1 names it."""
    mon, findings = _train_log(guard=False)
    issues = _warnings(findings)
    assert issues == ["the first non-finite value on rank 0 appeared as a NaN inside its forward (an operation's output, "
                      "found by the NaN scan): module '1' (SafeLog) at step 1"], issues
    assert all(math.isfinite(x) for x in [mon.last["loss"]])
    assert not mon.scan.armed and all(not m._forward_hooks and not m._forward_pre_hooks for m in mon.model.modules())


def test_scan_covers_one_forward_and_waits_for_the_step():
    """Armed at step 0, the scan sees the first forward only (not an evaluation loop after it);
    its result waits for after_backward; then no hook is left until the next scanned step."""
    torch.manual_seed(0)  # some of the first layer's outputs below -1 (the NaN to find), in any test order
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), SafeLog(False), torch.nn.Linear(8, 1))
    mon = TrainingMonitor(model, every=5)
    assert mon.scan.armed and mon.scan.waiting
    loss = model(-torch.ones(2, 4) * 10).pow(2).mean()  # log1p of values < -1: NaN, replaced
    assert not mon.scan.armed and mon.scan.waiting
    with torch.no_grad():
        model(torch.ones(2, 4))  # an evaluation forward: not scanned, no hook left to run
    loss.backward()
    mon.after_backward(loss, 0)
    assert mon.scan.armed and mon.scan.naming and mon.scan.step == 1  # read, then armed to name it at step 1
    mon.close()
    assert not mon.scan.armed


def test_guarded_log_is_quiet():
    _, findings = _train_log(guard=True)
    assert _warnings(findings) == []


# ---------------------------------------------------------------- loss spikes
def _regressor_run(seed: int, bad_step: int | None):
    """The docs' Lightning example (docs/integrations/lightning.md) as a plain loop: 4096 random
    points in batches of 64 in order, 2 epochs, SGD lr 0.05; the MSE of one batch of this small
    model reaches 3-4x its running median as plain noise."""
    torch.manual_seed(seed)
    x = torch.randn(4096, 8)
    y = torch.sin(x[:, :1])
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    mon = TrainingMonitor(net, every=10)
    for step in range(128):
        b = slice((step % 64) * 64, (step % 64 + 1) * 64)
        target = y[b] * (20.0 if step == bad_step else 1.0)  # a corrupt batch: labels scaled
        loss = torch.nn.functional.mse_loss(net(x[b]), target)
        loss.backward()
        mon.after_backward(loss, step)
        opt.step()
        opt.zero_grad()
    return mon.close()


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_batch_noise_is_not_a_spike(seed):
    assert _warnings(_regressor_run(seed, None), "loss spiked") == []


def test_corrupt_batch_is_a_spike():
    """Labels x20 at step 90: named at step 90 (the update it made may upset the next few steps too)."""
    issues = _warnings(_regressor_run(0, 90), "loss spiked")
    assert issues[0].startswith("loss spiked at step 90 to") and "x the highest of the 90 steps before" in issues[0], issues
    assert all(90 <= int(i.split()[4]) <= 99 for i in issues), issues


# ---------------------------------------------------------------- analyze: flat from the first logged point
def _logged_run(path, first: int, every: int):
    """A real run that converges in ~30 steps, its loss logged every `every` steps from `first`."""
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.2)
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(4, 1, generator=gen)
    lines = []
    for step in range(2000):
        x = torch.randn(64, 4, generator=gen)
        loss = (net(x) - x @ w - 0.1 * torch.randn(64, 1, generator=gen)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step >= first and (step - first) % every == 0:
            lines.append(json.dumps({"step": step, "loss": loss.item()}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _plateau(path):
    from distdiag.analyze import analyze, load_run

    report = analyze([load_run(path)])
    return [(f.severity, f.issue) for f in report.probe("plateau").findings]


def test_converged_before_first_logged_point_is_not_never_decreased(tmp_path):
    """Logged every 50 steps from step 49 (Lightning's default): flat at the noise floor is info."""
    got = _plateau(_logged_run(tmp_path / "late.jsonl", 49, 50))
    assert got and all(sev == "info" for sev, _ in got), got
    assert "converged before the first logged step 49, or never learned" in got[0][1] and "never decreased)" not in got[0][1]


def test_flat_from_step_0_is_still_never_decreased(tmp_path):
    """Logged from step 0 with a learning rate of 0 (the twin that never learns): a warning."""
    from distdiag.analyze.detectors import detect_plateau
    from distdiag.analyze.series import Series

    gen = torch.Generator().manual_seed(7)
    vals = (2.3 + 0.05 * torch.randn(200, generator=gen)).tolist()
    (det,) = detect_plateau(Series("loss", list(range(0, 2000, 10)), vals))
    assert det.finding.severity == "warning" and "(it never decreased)" in det.finding.issue


# ---------------------------------------------------------------- codebook use
def _train_vq(codebook_offset: float):
    """A tiny VQ-VAE (16 codes of dim 4, straight-through, codebook + 0.25 commitment loss).
    codebook_offset: where the codebook starts; far from the encoder's outputs, only the nearest
    code is ever chosen and the others, never chosen, never move (dead codes)."""
    torch.manual_seed(0)
    enc, dec, book = torch.nn.Linear(8, 4), torch.nn.Linear(4, 8), torch.nn.Embedding(16, 4)
    torch.nn.init.uniform_(book.weight, -1.0, 1.0)
    with torch.no_grad():
        book.weight += codebook_offset
    model = torch.nn.ModuleDict({"enc": enc, "dec": dec, "book": book})
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    mon = TrainingMonitor(model, every=5, num_codes=16)
    gen = torch.Generator().manual_seed(8)
    for step in range(40):
        x = torch.randn(64, 8, generator=gen)
        z = enc(x)
        codes = torch.cdist(z, book.weight).argmin(dim=1)
        q = book(codes)
        recon = (dec(z + (q - z).detach()) - x).pow(2).mean()
        vq = (q - z.detach()).pow(2).mean() + 0.25 * (z - q.detach()).pow(2).mean()
        (recon + vq).backward()
        mon.after_backward(recon + vq, step, codes=codes)
        opt.step()
        opt.zero_grad()
    return mon, mon.close()


def test_codebook_in_reach_of_the_encoder_is_quiet():
    mon, findings = _train_vq(0.0)
    assert _warnings(findings) == [] and mon.last["codes"]["used_frac"] >= 0.25, mon.last["codes"]


def test_codebook_out_of_reach_collapses_onto_one_code():
    _, findings = _train_vq(10.0)
    issues = _warnings(findings, "only")
    assert len(issues) == 1 and issues[0].startswith("only 1 of the 16 codes are used at step 0"), _warnings(findings)


# ---------------------------------------------------------------- output entropy
def _train_bigram(*, lr: float, degenerate: bool):
    """A bigram LM (Embedding -> MLP, vocab 32) on the sequence t -> t+1 mod 32, which it can
    learn exactly; degenerate: every label is token 0 (a target of padding only)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    mon = TrainingMonitor(model, every=5, entropy_grace_steps=30)
    gen = torch.Generator().manual_seed(9)
    for step in range(60):
        ids = torch.randint(0, 32, (16, 8), generator=gen)
        labels = torch.zeros_like(ids) if degenerate else (ids + 1) % 32
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        mon.after_backward(loss, step, logits=logits)
        opt.step()
        opt.zero_grad()
    return mon, mon.close()


def test_model_sure_of_a_different_token_at_each_position_is_quiet():
    """Learned exactly: entropy per position near 0, the old check called it collapsed."""
    mon, findings = _train_bigram(lr=0.1, degenerate=False)
    assert mon.last["entropy"] < 0.02 * math.log(32), mon.last
    assert _warnings(findings) == []


def test_output_collapsed_onto_one_token_is_named():
    _, findings = _train_bigram(lr=0.1, degenerate=True)
    issues = _warnings(findings, "output")
    assert len(issues) == 1 and issues[0].startswith("output collapsed onto few tokens at step"), _warnings(findings)


def test_output_near_uniform_after_the_grace_steps_is_named():
    """Learning rate 0: the output stays near-uniform; named at the first look from step 30."""
    _, findings = _train_bigram(lr=0.0, degenerate=False)
    issues = _warnings(findings, "output entropy")
    assert len(issues) == 1 and "at step 30 is" in issues[0] and "near-uniform" in issues[0], _warnings(findings)


def test_nan_replaced_inside_then_a_nan_loss_are_both_named():
    """The replaced NaN from step 0 (a warning), then from step 8 a NaN loss from another module:
    the error's own origin is still traced and named."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), SafeLog(False), torch.nn.Linear(8, 1), LogZeroAfter())
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    mon = TrainingMonitor(model, every=5)
    gen = torch.Generator().manual_seed(5)
    for step in range(16):
        model[3].on = step >= 8
        loss = model(torch.randn(16, 4, generator=gen)).pow(2).mean()
        loss.backward()
        mon.after_backward(loss, step)
        if torch.isfinite(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e3)):
            opt.step()
        opt.zero_grad()
    issues = [f.issue for f in mon.close() if "first non-finite" in f.issue]
    assert len(issues) == 2 and "as a NaN inside its forward" in issues[0] and "module '1' (SafeLog) at step 1" in issues[0], issues
    assert "in its forward: module '3' (LogZeroAfter) at step 11" in issues[1], issues


class LogZeroAfter(LogZero):
    """test_monitor's LogZero (-inf once `on`) under the name this file's findings quote."""
