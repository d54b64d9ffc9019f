"""hp_rewrite.fully_shard (FSDP2: experts over the expert-replica mesh, the rest over data parallel),
run on every rank of a real gloo world against the unmodified model stepped on the concatenated
batch of every rank."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import hp_rewrite
from hp_rewrite.loading.patch import rewrite_model
from hp_rewrite.plan import parse_plan
from hp_rewrite.runtime.binding.install import expert_weights, local_rows
from hp_rewrite.tiny import build_tiny_model, tiny_config
from tests.engine_cases import _error, _optimizer, lent_bytes, lent_or_guests
from tests.training_cases import _lm_loss


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _compare(model, ref, get) -> tuple[float, str]:
    """Worst relative difference, sharded tensors gathered (every rank calls it: collective)."""
    ref_params = dict(ref.named_parameters())
    weights = expert_weights(model)
    worst = (0.0, "")
    for name, p in model.named_parameters():
        value, target = _full(get(p)).float(), _full(get(ref_params[name])).float()
        if name in weights and target.shape != value.shape:  # this rank's experts (flat, zero-expert layouts too)
            target = local_rows(*weights[name], target)
        worst = max(worst, (((value - target).abs().max() / target.abs().max().clamp_min(1e-12)).item(), name))
    return worst


BALANCED = "runtime: {balance: auto, balance_threshold: 1.0, balance_min_rows: 1}\n"  # any imbalance, any piece


def fsdp_training(rank: int, world: int, payload: dict) -> dict:
    torch.set_num_threads(1)
    config = tiny_config(payload.get("model_type", "qwen3_moe"))
    if payload.get("num_experts"):  # e.g. 3 local experts over 2 expert replicas: Shard(1), not a padded dim 0
        config.num_experts = payload["num_experts"]
    ref = build_tiny_model(config, seed=0).train()
    plan = parse_plan(f"version: 1\nep_size: {payload['ep_size']}\n{payload.get('plan', '')}")
    mesh = None
    if payload.get("mesh"):  # the user's mesh, e.g. (dp_replicate, efsdp, ep): the EP groups come from it
        from torch.distributed.device_mesh import init_device_mesh

        shape = tuple(payload["mesh"])
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp_replicate", "efsdp", "ep")[-len(shape):])
    model = rewrite_model(copy.deepcopy(ref), plan, artifact_dir=Path(payload["out_dir"]), mesh=mesh)
    if payload.get("checkpointing"):
        for m in (ref, model):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = None
    if payload.get("bf16"):  # the reference: the unmodified model under plain FSDP2 with the same policy
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in ref.model.layers:
            torch_fully_shard(layer, mp_policy=mp)
        torch_fully_shard(ref, mp_policy=mp)
    hp_rewrite.fully_shard(model, mp_policy=mp)  # over the mesh the EP groups come from
    out_mesh = model.hp_rewrite.ep.mesh
    out = {"mesh_is_users": mesh is None or out_mesh is mesh, "replica_size": model.hp_rewrite.ep.replica_size}
    name, lr, max_norm = payload.get("optimizer", "sgd"), payload.get("lr", 1.0), payload.get("max_norm")
    opt_ref, opt = _optimizer(name, ref.parameters(), lr), _optimizer(name, model.parameters(), lr)
    per_rank, seq = 2, 8
    vocab = ref.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(7)
    out.update(norms=[], ref_norms=[])
    for step in range(payload.get("steps", 1)):
        ids = torch.randint(0, vocab, (world * per_rank, seq), generator=gen)
        mine = ids[rank * per_rank : (rank + 1) * per_rank]
        ref_ids = mine if payload.get("bf16") else ids  # plain FSDP2 reference: each rank its own share too
        _lm_loss(ref(input_ids=ref_ids).logits, ref_ids).backward()
        _lm_loss(model(input_ids=mine).logits, mine).backward()
        if step == 0:
            out["grad_worst"], out["grad_worst_name"] = _compare(model, ref, lambda p: p.grad)
        if max_norm is not None:
            clip = hp_rewrite.clip_grad_norm_ if payload.get("bf16") else torch.nn.utils.clip_grad_norm_
            out["ref_norms"].append(_full(clip(ref.parameters(), max_norm)).item())
            out["norms"].append(hp_rewrite.clip_grad_norm_(model.parameters(), max_norm).item())
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    out["worst"], out["worst_name"] = _compare(model, ref, lambda p: p.detach())
    out["guests"] = lent_or_guests(model)
    out["lent_bytes"] = lent_bytes(model)[0]
    if payload.get("save"):  # gathered one layer at a time; plain transformers loads the trained model
        import torch.distributed as dist
        from transformers import AutoModelForCausalLM

        saved = Path(payload["out_dir"]) / "saved"
        hp_rewrite.save_pretrained(model, saved)
        full = {n: _full(p.detach()) for n, p in model.named_parameters()}  # collective: every rank
        if rank == 0:
            plain = AutoModelForCausalLM.from_pretrained(saved)
            target = dict(ref.named_parameters())
            out["saved_worst"] = max(((q - target[n].detach()).abs().max() / target[n].abs().max()).item()
                                     for n, q in plain.named_parameters())
            mine = {n: q for n, q in plain.named_parameters() if n in full and q.shape == full[n].shape}
            out["saved_equals_dense"] = all(torch.equal(q, full[n]) for n, q in mine.items()
                                            if "experts" not in n)
        dist.barrier()
        # streamed as RL hands weights to an inference engine (#46): what save_pretrained wrote
        from safetensors.torch import load_file

        from tests.weights_cases import stream_problems

        out["stream_problems"] = stream_problems(model, load_file(saved / "model.safetensors"), "fsdp2", rank, world)
    params = dict(model.named_parameters())
    experts = params[next(iter(expert_weights(model)))]  # the first layer's first expert weight
    dense = next(p for n, p in params.items() if n not in expert_weights(model) and p.dim() == 2)
    out["expert_mesh"] = experts.device_mesh.size()
    out["expert_local_shape"] = list(experts.to_local().shape)
    out["expert_placement"] = str(experts.placements[-1])
    out["dense_mesh"] = dense.device_mesh.size()
    return out


def _each_case(run, rank: int, world: int, payload: dict) -> dict:
    """Several cases of ``run`` in one world (one start-up): {case: its result}, each in its own folder."""
    return {name: run(rank, world, {**case, "out_dir": str(Path(payload["out_dir"]) / name)})
            for name, case in payload["cases"].items()}


def fsdp_training_cases(rank: int, world: int, payload: dict) -> dict:
    return _each_case(fsdp_training, rank, world, payload)


def dcp_resume_cases(rank: int, world: int, payload: dict) -> dict:
    return _each_case(dcp_resume, rank, world, payload)


def fsdp_refusals(rank: int, world: int, payload: dict) -> dict:
    """What does not compose with hp_rewrite.fully_shard ends in a clear error on every rank."""
    torch.set_num_threads(1)
    ref = build_tiny_model(tiny_config("qwen3_moe"), seed=0).train()
    art = Path(payload["out_dir"])
    ids = torch.randint(0, ref.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(rank))
    out = {}
    deferred = rewrite_model(copy.deepcopy(ref), parse_plan(
        f"version: 1\nep_size: {world}\nruntime: {{defer_expert_grads: true}}\n"), artifact_dir=art)
    out["deferred"] = _error(lambda: hp_rewrite.fully_shard(deferred))
    # runtime.balance: flat expert weights are refused (FSDP2 and LoRA on the experts compose: fsdp_training)
    balance = parse_plan(f"version: 1\nep_size: {world}\nruntime: {{balance: auto}}\n")
    out["balance_flat"] = _error(lambda: rewrite_model(build_tiny_model(tiny_config("dbrx"), seed=0), balance,
                                                       artifact_dir=art))
    model = rewrite_model(copy.deepcopy(ref), parse_plan(f"version: 1\nep_size: {world}\n"), artifact_dir=art)
    hp_rewrite.fully_shard(model)
    _lm_loss(model(input_ids=ids).logits, ids).backward()
    out["sync_gradients"] = _error(lambda: hp_rewrite.sync_gradients(model))
    out["gradient_sync"] = _error(lambda: hp_rewrite.gradient_sync(model))
    try:  # torch's own clip refuses gradients on two meshes (its message, not ours)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        out["torch_clip"] = ""
    except RuntimeError as e:
        out["torch_clip"] = str(e)[:200]

    def step():
        _lm_loss(model(input_ids=ids).logits, ids).backward()

    with hp_rewrite.Interleaver() as il:
        out["interleaver"] = _error(lambda: il.run([step, step]))
    wrong = rewrite_model(copy.deepcopy(ref), parse_plan(f"version: 1\nep_size: {world}\n"), artifact_dir=art)
    from torch.distributed.device_mesh import init_device_mesh

    # a mesh whose 'ep' dimension is not the plan's ep_size, or not the last one
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("efsdp", "ep"))
    out["mesh_fsdp"] = _error(lambda: hp_rewrite.fully_shard(wrong, mesh=mesh))
    plan = parse_plan(f"version: 1\nep_size: {world}\n")
    out["mesh_rewrite"] = _error(lambda: rewrite_model(copy.deepcopy(ref), plan, artifact_dir=art, mesh=mesh))
    # the user's mesh through the loading entry points: the EP groups are its 'ep' dimension
    users = init_device_mesh("cpu", (1, world), mesh_dim_names=("efsdp", "ep"))
    loaded = hp_rewrite.from_pretrained(payload["model_dir"], plan, artifact_dir=art, mesh=users)
    with hp_rewrite.auto_patch(plan, artifact_dir=art, mesh=users):
        from transformers import AutoModelForCausalLM

        patched = AutoModelForCausalLM.from_pretrained(payload["model_dir"])
    out["mesh_from_pretrained"] = loaded.hp_rewrite.ep.mesh is users and loaded.hp_rewrite.ep.size == world
    out["mesh_auto_patch"] = patched.hp_rewrite.ep.mesh is users
    transposed = init_device_mesh("cpu", (world, 1), mesh_dim_names=("ep", "efsdp"))
    out["mesh_order"] = _error(lambda: rewrite_model(copy.deepcopy(ref), plan, artifact_dir=art, mesh=transposed))
    return out


def dcp_resume(rank: int, world: int, payload: dict) -> dict:
    """torch.distributed.checkpoint through hp_rewrite.save_checkpoint / load_checkpoint: two AdamW
    steps uninterrupted, against one step, a save, then for each of ``loads`` (EP size, sharded, mesh)
    a load into a fresh model and optimizer and the second step."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    ref = build_tiny_model(tiny_config(payload.get("model_type", "qwen3_moe")), seed=0).train()
    out_dir = Path(payload["out_dir"])
    art = out_dir / "art"
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, ref.config.vocab_size, (2 * world, 8), generator=gen) for _ in range(2)]

    def build(ep: int, shard: bool, hsdp: bool = False):
        mesh = None
        if hsdp:  # the user's (dp_replicate, efsdp, ep) mesh
            mesh = init_device_mesh("cpu", (2, world // 2 // ep, ep), mesh_dim_names=("dp_replicate", "efsdp", "ep"))
        model = rewrite_model(copy.deepcopy(ref), parse_plan(f"version: 1\nep_size: {ep}\n"), artifact_dir=art,
                              mesh=mesh)
        if shard:
            hp_rewrite.fully_shard(model)
        wrapped = model if shard else torch.nn.parallel.DistributedDataParallel(model)
        return model, wrapped, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)

    def step(wrapped, optimizer, ids):
        mine = ids[2 * rank : 2 * rank + 2]
        _lm_loss(wrapped(input_ids=mine).logits, mine).backward()
        optimizer.step()
        optimizer.zero_grad()

    model, wrapped, optimizer = build(payload["ep_save"], payload["shard_save"])
    step(wrapped, optimizer, batches[0])
    hp_rewrite.save_checkpoint(model, optimizer, out_dir / "dcp")
    step(wrapped, optimizer, batches[1])
    hp_rewrite.save_pretrained(model, out_dir / "uninterrupted")  # every expert, in standard format
    out = {"worst": [], "moved": None}
    for i, (ep, shard, hsdp) in enumerate(payload["loads"]):
        resumed, wrapped2, optimizer2 = build(ep, shard, hsdp)
        hp_rewrite.load_checkpoint(resumed, optimizer2, out_dir / "dcp")
        step(wrapped2, optimizer2, batches[1])
        hp_rewrite.save_pretrained(resumed, out_dir / f"resumed{i}")
        if rank == 0:
            from transformers import AutoModelForCausalLM

            a = AutoModelForCausalLM.from_pretrained(out_dir / "uninterrupted").state_dict()
            b = AutoModelForCausalLM.from_pretrained(out_dir / f"resumed{i}").state_dict()
            start = ref.state_dict()
            out["worst"].append(max(((a[k] - b[k]).abs().max() / a[k].abs().max()).item() for k in a))
            out["moved"] = min((a[k] - start[k]).abs().max().item() for k in a if "norm" not in k)
        dist.barrier()
    return out


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def model_ep(plan):
    from hp_rewrite.loading.patch import expert_parallel_group_for

    return expert_parallel_group_for(plan)


def sharded_load(rank: int, world: int, payload: dict) -> dict:
    """hp_rewrite.load_fully_sharded: every shard equals the checkpoint's slice, and the peak RSS of
    the load over the RSS before it, against this rank's final bytes (its shards and buffers)."""
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    plan = parse_plan(f"version: 1\nep_size: {payload['ep_size']}\n")
    art = Path(payload["out_dir"]) / "art"
    from hp_rewrite.loading import local

    # one-time costs out of the measurement: imports and first uses (a load of a tiny checkpoint), and
    # the artifact of this model (its analysis probes a block on rank 0), then freed memory given back
    warm = hp_rewrite.load_fully_sharded(payload["warmup_dir"], plan, artifact_dir=art)
    del warm
    local.prepare(payload["model_dir"], plan, model_ep(plan), art)
    local._release_freed_memory()
    Path("/proc/self/clear_refs").write_text("5")
    baseline = _status_kib("VmRSS") * 1024
    model = hp_rewrite.load_fully_sharded(payload["model_dir"], plan, artifact_dir=art, chunk_bytes=2**20)
    peak = _status_kib("VmHWM") * 1024
    final = sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size()
                for t in list(model.parameters()) + list(model.buffers()))
    ref = AutoModelForCausalLM.from_pretrained(payload["model_dir"], attn_implementation="eager").eval()
    worst = _compare(model, ref, lambda p: p.detach())[0]
    ids = torch.randint(0, ref.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        logits = (model(input_ids=ids).logits - ref(input_ids=ids).logits).abs().max().item()
    out = {"peak": peak - baseline, "final": final, "worst": worst, "logits": logits,
           "read": model.hp_rewrite.load_report["bytes_read"]}
    if payload.get("missing_dir"):  # tensors the checkpoint lacks (#44): drawn as plain transformers draws them
        streams = []
        for load in (lambda d: hp_rewrite.load_fully_sharded(d, plan, artifact_dir=art),
                     lambda d: AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager")):
            torch.manual_seed(0)
            streams.append((load(payload["missing_dir"]), torch.random.get_rng_state()))
        (ours, after_ours), (plain, after_plain) = streams
        out["missing_worst"] = _compare(ours, plain, lambda p: p.detach())
        out["missing_stream"] = torch.equal(after_ours, after_plain)
    return out


def peft_fsdp(rank: int, world: int, payload: dict) -> dict:
    """PEFT LoRA under hp_rewrite.fully_shard: the adapters on the experts sharded with them over the
    expert-replica mesh (the rest over the world), against the unmodified model with the same adapters
    on the concatenated batch: gradients, clipped steps, and the adapter PEFT saves."""
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file

    from tests.peft_cases import copy_local_adapters, expert_slicers

    torch.set_num_threads(1)
    out_dir = Path(payload["out_dir"])
    ref = build_tiny_model(tiny_config("qwen3_moe"), seed=0).train()
    plan = parse_plan(f"version: 1\nep_size: {payload['ep_size']}\n{payload.get('plan', '')}")
    model = rewrite_model(copy.deepcopy(ref), plan, artifact_dir=out_dir)
    config = {"target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
    if not payload.get("experts_only"):
        config["target_modules"] = ["q_proj", "v_proj"]
    torch.manual_seed(3)
    peft_ref = get_peft_model(ref, LoraConfig(r=2, lora_alpha=4, init_lora_weights=False, **config))
    torch.manual_seed(3)
    peft_ep = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, init_lora_weights=False, **config))
    slicers = expert_slicers(peft_ep, peft_ref)
    copy_local_adapters(peft_ep, peft_ref, slicers)
    if payload.get("checkpointing"):
        for m in (peft_ref, peft_ep):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hp_rewrite.fully_shard(peft_ep)
    trainable = {n: p for n, p in peft_ep.named_parameters() if p.requires_grad}
    ref_params = dict(peft_ref.named_parameters())

    def worst(get) -> tuple[float, str]:
        found = (0.0, "")
        for name, p in trainable.items():
            target = get(ref_params[name])
            target = slicers[name](target) if name in slicers else target
            value = _full(get(p))
            found = max(found, (((value - target).abs().max() / target.abs().max().clamp_min(1e-12)).item(), name))
        return found

    name, lr, max_norm = payload.get("optimizer", "adamw"), payload.get("lr", 1e-3), payload.get("max_norm", 0.5)
    opt_ref = _optimizer(name, [p for p in ref_params.values() if p.requires_grad], lr)
    opt = _optimizer(name, list(trainable.values()), lr)
    vocab, per_rank = ref.config.vocab_size, 2
    gen = torch.Generator().manual_seed(7)
    out = {"norms": [], "ref_norms": [], "trainable": len(trainable), "local_adapters": len(slicers)}
    for step in range(2):
        ids = torch.randint(0, vocab, (world * per_rank, 8), generator=gen)
        mine = ids[rank * per_rank : (rank + 1) * per_rank]
        _lm_loss(peft_ref(input_ids=ids).logits, ids).backward()
        _lm_loss(peft_ep(input_ids=mine).logits, mine).backward()
        if step == 0:
            out["grad_worst"], out["grad_worst_name"] = worst(lambda p: p.grad)
        out["ref_norms"].append(torch.nn.utils.clip_grad_norm_(opt_ref.param_groups[0]["params"], max_norm).item())
        out["norms"].append(hp_rewrite.clip_grad_norm_(peft_ep.parameters(), max_norm).item())
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
    out["worst"], out["worst_name"] = worst(lambda p: p.detach())
    out["guests"] = lent_or_guests(peft_ep)
    out["lent_bytes"], out["lent_grad_bytes"] = lent_bytes(peft_ep)
    adapter = next(p for n, p in trainable.items() if n in slicers)
    out["adapter_mesh"] = adapter.device_mesh.size()
    out["adapter_local_rows"] = adapter.to_local().shape[0]
    out["adapter_rows"] = adapter.shape[0]
    if not payload.get("save", True):
        return out
    ep_dir, ref_dir = out_dir / "adapter_ep", out_dir / "adapter_ref"
    peft_ep.save_pretrained(ep_dir, is_main_process=rank == 0)  # every rank: gathered, rank 0 writes
    if rank == 0:
        peft_ref.save_pretrained(ref_dir)
    dist.barrier()
    got, want = load_file(ep_dir / "adapter_model.safetensors"), load_file(ref_dir / "adapter_model.safetensors")
    out["file_keys"] = sorted(got) == sorted(want)
    out["file_worst"] = max(((got[k] - want[k]).abs().max() / want[k].abs().max()).item() for k in want)
    # plain PEFT's file read into the sharded model: each rank's shard of its experts' adapters, exactly
    with torch.no_grad():  # zeroed first: what is compared afterwards is what the load wrote
        for p in trainable.values():
            p.zero_()
    peft_ep.load_adapter(ref_dir, adapter_name="default", is_trainable=True)
    trainable = {n: p for n, p in peft_ep.named_parameters() if p.requires_grad}
    out["loaded_worst"] = worst(lambda p: p.detach())[0]
    out["loaded_sharded"] = len(trainable) == out["trainable"] and all(hasattr(p, "device_mesh")
                                                                       for p in trainable.values())
    out["dcp_refused"] = _error(lambda: hp_rewrite.save_checkpoint(peft_ep, opt, out_dir / "dcp"))
    # the merged weights streamed (#46): plain PEFT's merge_and_unload of the same adapters, as saved
    from tests.weights_cases import plain_files, stream_problems

    want = plain_files(peft_ref.merge_and_unload(), out_dir / "merged")
    out["stream_problems"] = stream_problems(peft_ep, want, "fsdp2 peft", rank, world,
                                             merged=("q_proj", "v_proj", ".experts."))  # deltas of FSDP2 shards
    return out
