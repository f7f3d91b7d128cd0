"""The configuration of a ``qwire train`` run: a plain dataclass, every field a command-line option.

Each field carries its help text (``_opt(default, help)``), so ``qwire train --help``, config files
(:func:`load_config_file`) and the saved ``config.json`` of a run directory all speak of the same names.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qwire.netlab.spec import LINK_FIELDS, parse_link, parse_link_schedule

SCHEDULES = ("gpipe", "1f1b")

# --laaq policies: keyword arguments of qwire.memory.LAAQPolicy; "stage_aware" applies AGoQ's
# per-stage bits b_i = max(4, 4 N_1 / N_i) from the micro-batches each stage holds in flight.
LAAQ_POLICIES: dict[str, dict[str, Any]] = {
    "agoq": {"bits": 4, "fmt": "fp", "block": 128, "recompute": (r"mlp$",), "stage_aware": True},
    "int4": {"bits": 4, "fmt": "int", "block": 128, "stage_aware": True},
    "uniform4": {"bits": 4, "fmt": "fp", "block": 128, "keep_attention": False, "stage_aware": False},
    "keep": {"fmt": "none", "stage_aware": False},
}

MAX_WAIT_S = 30 * 86400  # the longest --timeout (or --stall-warn) taken: every wait ends

# Fields that say how a run runs, not what it trains: a resumed run (--resume, --resume auto) takes them from its
# command line, so a job requeued on another network, or given a longer --timeout, continues its run.
RUNTIME_FIELDS = ("timeout", "stall_warn", "peer_timeout", "log_every", "eval_every", "checkpoint_every", *LINK_FIELDS)

# The codecs of a run, as options: a run directory's codecs.json pins each with every parameter written out
# (codec_pins), so that a resumed run keeps its codecs when a later version changes a default (with_pinned_codecs).
CODEC_FIELDS = ("fwd_codec", "bwd_codec", "tp_codec", "dp_codec", "dp_param_codec")
CODEC_PINS = "codecs.json"
NESTED_PINS = {"nested": "pinned"}  # in codecs.json: the codecs named inside a codec (aqsgd's inner) are pinned too
CODEC_ROLES = {"fwd_codec": "pipeline", "bwd_codec": "pipeline", "tp_codec": "tp", "dp_codec": "dp",
               "dp_param_codec": "dp_param"}

# Fields that may differ between ranks of one job (each machine names its own run directory, device and links).
PER_RANK_FIELDS = ("out", "device", *LINK_FIELDS)


def _opt(default: Any, help: str) -> Any:
    return dataclasses.field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    stages: int = _opt(4, "pipeline stages (one stage per process, times --tp x --dp)")
    schedule: str = _opt("1f1b", "pipeline schedule: gpipe | 1f1b")
    microbatches: int = _opt(4, "micro-batches per step (--batch-size must be divisible by it)")
    batch_size: int = _opt(8, "sequences per optimizer step (per data-parallel replica)")
    seq_len: int = _opt(128, "tokens per sequence")
    model: str = _opt("llama-tiny", "a preset name, a local Hugging Face model directory (config.json, weights, "
                                    "tokenizer), a config.json file (a new model), or hf:ORG/NAME (downloaded)")
    split: str = _opt("", 'decoder layers per stage, e.g. "3,2,2,1" (default: even)')
    corpus: str = _opt("stdlib", '"stdlib", a file, a folder, or "jsonl:PATH"')
    vocab_size: int = _opt(4096, "vocabulary of the tokenizer trained on the corpus")
    fwd_codec: str = _opt("tahquant", "codec of the activations going forward between stages")
    bwd_codec: str = _opt("perchannel6", "codec of the gradients going back between stages")
    optimizer: str = _opt("adamw", "adamw | sgd")
    lr: float = _opt(3e-3, "peak learning rate")
    weight_decay: float = _opt(0.0, "weight decay")
    warmup: int = _opt(20, "linear warm-up steps, then cosine decay to lr/10")
    grad_clip: float = _opt(1.0, "max global grad norm (0 disables)")
    seed: int = _opt(0, "seed of the model init and the data order")
    steps: int = _opt(300, "optimizer steps of the whole run")
    device: str = _opt("cpu", "cpu (gloo) | cuda (nccl, or gloo when ranks share a GPU: --backend)")
    backend: str = _opt("auto", "auto | gloo | nccl: the transport. auto: gloo on cpu; on cuda nccl when no two "
                                "ranks of the job run on one GPU (the ranks compare their GPUs' UUIDs at start-up), "
                                "else gloo with every payload staged through pinned host memory (several ranks "
                                "sharing one GPU)")
    codec_graphs: bool = _opt(False, "with --device cuda: capture each codec's GPU kernels in a CUDA graph per tensor "
                              "shape and replay it (one launch per encode and decode instead of the codec's host "
                              "work; the same bytes; docs/kernels.md). Not yet timed on a GPU")
    eval_every: int = _opt(100, "steps between validation runs (0: only at the end)")
    eval_batches: int = _opt(8, "validation batches per evaluation (0: no validation; the loss is NaN)")
    log_every: int = _opt(10, "steps between progress lines")
    checkpoint_every: int = _opt(100, "steps between checkpoints (0: only at the end)")
    out: str = _opt("", "run directory (default: runs/<time>-<fwd>; under torchrun it must be given)")
    timeout: float = _opt(300.0, "seconds any rendezvous or collective may wait")
    stall_warn: float = _opt(60.0, "warn, naming the ranks it waits on, when a step (or evaluation, checkpoint) has "
                             "run this many seconds and 10x its median duration (0: off; heartbeats through the "
                             "rendezvous store)")
    peer_timeout: float = _opt(0.0, "end the run when this rank's step (or evaluation, checkpoint) is late "
                               "(--stall-warn) and a rank it may wait on has sent no heartbeat for this many "
                               "seconds (a stopped or frozen process or machine) or failed, instead of waiting "
                               "for --timeout; with torchrun --max-restarts and --resume auto the job then "
                               "restarts sooner (0: off)")
    max_tokens: int = _opt(0, "cap on corpus tokens (0: the corpus default)")
    link: str = _opt("", 'rate-limited links between ranks, e.g. "100mbit,delay=20ms" (network lab)')
    link_pp: str = _opt("", "links between pipeline stages (default: --link)")
    link_tp: str = _opt("", "links between tensor-parallel ranks (default: --link)")
    link_dp: str = _opt("", "links between data-parallel replicas (default: --link)")
    link_schedule: str = _opt("", 'change the rate of --link during the run, e.g. "20:20mbit;40:200mbit" (after '
                              'step 20: 20 Mbit/s; network lab only)')
    tp: int = _opt(1, "tensor-parallel ranks per stage (Llama, Qwen2, Qwen3, Mistral models)")
    tp_codec: str = _opt("fp8", "codec of the tensor-parallel collectives, forward and backward (auto[:options]: "
                         "chosen from measurements; fp8:group=auto: the group size from the measured tensor; "
                         "docs/auto.md)")
    dp: int = _opt(1, "data-parallel replicas of the whole pipeline")
    dp_codec: str = _opt("blockwise8:block=256", "codec of the data-parallel gradients (QuanGrad's all-reduce, or "
                         "the reduce-scatter with --dp-shard; with --dp-sync-every H > 1 DiLoCo's pseudo-gradients, "
                         "where blockwise4:block=256 halved the bytes at the same loss, docs/diloco.md); "
                         "torch-fp16: PyTorch's own DDP fp16 hook, a reference; auto[:options]: chosen from "
                         "measurements (docs/auto.md)")
    dp_shard: bool = _opt(False, "shard the data-parallel replicas with FSDP2 (gradients reduce-scattered, weights "
                          "all-gathered through qwire's codecs) instead of replicating them (DDP)")
    dp_param_codec: str = _opt("", "with --dp-shard: codec of the weight all-gather, e.g. fp8 or blockwise8 (the "
                               "master weights stay exact; default: uncompressed)")
    dp_keep_weights: bool = _opt(False, "with --dp-shard: keep the gathered weights for the whole step (one weight "
                                 "all-gather per step instead of one per forward and backward; the stage's full "
                                 "weights are held during the step, ZeRO-2's trade)")
    dp_sync_every: int = _opt(1, "DiLoCo: the replicas train on their own and average their pseudo-gradients (the "
                              "parameters' change since they last met, through --dp-codec) every this many steps, "
                              "then take an outer Nesterov step; 1: average the gradients every step (DDP)")
    dp_sync_overlap: int = _opt(0, "with --dp-sync-every H > 1: the replicas go on training while a meeting's "
                                "all-reduce crosses the link, and its outer step lands this many steps later "
                                "(< H / --dp-sync-fragments; the steps in between are kept on top of it); 0: every "
                                "replica waits for the meeting")
    dp_sync_fragments: int = _opt(1, "with --dp-sync-every H > 1: cut the parameters into this many fragments "
                                  "that meet in turn, one every H / F steps (Streaming DiLoCo): each meeting "
                                  "sends 1/F of the bytes; F must divide H, and --dp-sync-overlap be < H / F")
    outer_lr: float = _opt(0.5, "with --dp-sync-every > 1: learning rate of DiLoCo's outer SGD (the paper: 0.7; "
                                "docs/diloco.md measures both)")
    outer_momentum: float = _opt(0.5, "with --dp-sync-every > 1: Nesterov momentum of DiLoCo's outer SGD (0: none; "
                                      "the paper: 0.9, for hundreds of steps between meetings)")
    dp_error_feedback: bool = _opt(False, "with --dp-sync-every H > 1: keep what --dp-codec's quantization of the "
                                   "pseudo-gradients lost at a meeting and add it to the next meeting's (error "
                                   "feedback; one fp32 copy of the stage's parameters per rank): for 2-3 bit "
                                   "codecs such as int2; docs/diloco.md measured no gain at 4-8 bits and a loss "
                                   "with the 3-level blockwise:bits=2")
    grad_accum_bits: int = _opt(0, "8: accumulate the micro-batches' gradients in 8-bit blocks (AGoQ) instead of "
                                "fp32 (0: off)")
    laaq: str = _opt("", 'low-bit saved activations: agoq | int4 | uniform4 | keep ("" off)')

    @property
    def uses_links(self) -> bool:
        """Whether any rate-limited link was asked for (the run then goes through qwire.netlab)."""
        return bool(self.link or self.link_pp or self.link_tp or self.link_dp)

    @property
    def world(self) -> int:
        return self.stages * self.tp * self.dp

    def validate(self) -> None:
        """Raise ValueError naming the option to change; nothing is started before this passes."""
        import torch

        from qwire.codecs import CodecError, get_codec
        from qwire.codecs.auto import Auto, fp8_group_auto
        from qwire.comm.ddp_hooks import TORCH_HOOKS
        from qwire.data import parse_corpus_spec
        from qwire.models import model_source

        if self.stages < 1:
            raise ValueError(f"--stages must be >= 1, got {self.stages}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--schedule must be one of {sorted(SCHEDULES)}, got {self.schedule!r}")
        if self.microbatches < 1:
            raise ValueError(f"--microbatches must be >= 1, got {self.microbatches}")
        if self.batch_size < 1 or self.batch_size % self.microbatches:
            raise ValueError(
                f"--batch-size ({self.batch_size}) must be a positive multiple of --microbatches "
                f"({self.microbatches})"
            )
        if self.schedule == "1f1b" and self.microbatches < self.stages:
            raise ValueError(f"the 1f1b schedule needs --microbatches >= --stages ({self.stages}), got "
                             f"{self.microbatches}; raise --microbatches or use --schedule gpipe")
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"--optimizer must be adamw or sgd, got {self.optimizer!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for but torch sees no CUDA device")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"--backend must be auto, gloo or nccl, got {self.backend!r}")
        if self.backend == "nccl" and self.device != "cuda":
            raise ValueError("--backend nccl moves CUDA tensors only; add --device cuda, or use --backend gloo")
        from qwire.codecs.kernels import graphs

        graphs.enabled()  # a wrong QWIRE_CODEC_GRAPHS in the environment fails before anything starts
        for name in ("link", "link_pp", "link_tp", "link_dp"):
            if getattr(self, name):
                try:
                    parse_link(getattr(self, name))  # a bad link spec fails before anything starts
                except ValueError as e:
                    raise ValueError(f"--{name.replace('_', '-')}: {e}") from None
        if self.link_schedule:
            if not self.link or self.link_pp or self.link_tp or self.link_dp:
                raise ValueError("--link-schedule changes the rate of the one link given with --link; give --link "
                                 "(and no --link-pp/--link-tp/--link-dp)")
            try:
                parse_link_schedule(self.link_schedule, self.steps)
            except ValueError as e:
                raise ValueError(f"--link-schedule: {e}") from None
        if self.tp < 1 or self.dp < 1:
            raise ValueError(f"--tp and --dp must be >= 1, got {self.tp} and {self.dp}")
        if self.laaq and self.laaq not in LAAQ_POLICIES:
            raise ValueError(f"--laaq must be one of {', '.join(LAAQ_POLICIES)} (or empty), got {self.laaq!r}")
        self._check_numbers()
        if not 0 <= self.stall_warn <= MAX_WAIT_S:
            raise ValueError(f"--stall-warn must be >= 0 seconds (0 turns the stall warnings off) and at most "
                             f"{MAX_WAIT_S} (30 days), got {self.stall_warn}")
        if not 0 <= self.peer_timeout < self.timeout:
            raise ValueError(f"--peer-timeout must be >= 0 seconds (0: off) and below --timeout ({self.timeout:g}), "
                             f"got {self.peer_timeout:g}")
        if self.peer_timeout and not self.stall_warn:
            raise ValueError("--peer-timeout acts on the heartbeats that --stall-warn 0 turns off; give --stall-warn "
                             "(e.g. 60) or --peer-timeout 0")
        if self.peer_timeout and not self.stall_warn < self.timeout:  # it looks at peers once a step is late
            raise ValueError(f"--peer-timeout acts once a step is --stall-warn ({self.stall_warn:g} s) late, and "
                             f"--timeout ({self.timeout:g} s) ends the wait before that; give --stall-warn below "
                             f"--timeout (e.g. {self.timeout / 3:g}) or --peer-timeout 0")
        for name, role in (("tp_codec", "tp"), ("dp_codec", "dp"), ("dp_param_codec", "dp_param")):
            self._check_auto(name, role)
        try:
            shaped = fp8_group_auto(self.tp_codec) is not None
        except CodecError as e:
            raise ValueError(f"--tp-codec {self.tp_codec}: {e}") from None
        for name in ("fwd_codec", "bwd_codec"):  # a CodecError says what is wrong with the spec, this the option
            opt, spec = "--" + name.replace("_", "-"), getattr(self, name)
            try:
                codec = get_codec(spec)
            except CodecError as e:
                raise ValueError(f"{opt}: {e}") from None
            if isinstance(codec, Auto) and codec.rule == "shape":
                raise ValueError(f"{opt} {spec}: rule=shape picks TACO's fp8 group shape on the tensor-parallel "
                                 "collectives (--tp-codec fp8:group=auto); a pipeline boundary's auto chooses by "
                                 "time: leave rule out")
        self._check_pipeline_autos()
        for name, c in (("bwd_codec", self.bwd_codec), ("tp_codec", None if shaped else self.tp_codec),
                        ("dp_codec", None if self.dp_codec in TORCH_HOOKS else self.dp_codec),
                        ("dp_param_codec", self.dp_param_codec or None)):
            if c is not None and get_codec(c).stateful:
                raise ValueError(f"--{name.replace('_', '-')} {c}: AQ-SGD keeps a cache per training sample of "
                                 "the activations that crossed a stage boundary, so it compresses only those "
                                 f"(--fwd-codec); name a stateless codec here, e.g. "
                                 f"{'perchannel8 or ' if name == 'bwd_codec' else ''}blockwise8")
            if name != "bwd_codec" and c is not None and not isinstance(get_codec(c), Auto):
                self._check_flat_bytes(name, c)
        if self.dp_codec in TORCH_HOOKS and (self.dp_shard or self.tp > 1):
            raise ValueError(f"--dp-codec {self.dp_codec} is PyTorch's own DDP hook: it needs plain DDP (no "
                             "--dp-shard or --tp); name a qwire codec such as fp16 instead")
        if self.dp_shard and self.dp < 2:
            raise ValueError("--dp-shard shards the data-parallel replicas: give --dp >= 2")
        if self.dp_keep_weights and not self.dp_shard:
            raise ValueError("--dp-keep-weights keeps FSDP's gathered weights for the step: add --dp-shard")
        if self.dp_param_codec and not self.dp_shard:
            raise ValueError("--dp-param-codec is the codec of FSDP's weight all-gather: add --dp-shard")
        if self.dp_sync_every < 1:
            raise ValueError(f"--dp-sync-every must be >= 1 (1: average the gradients every step), got "
                             f"{self.dp_sync_every}")
        if self.dp_sync_every > 1:
            if self.dp > 1:  # (with --dp 1 the DiLoCo options are noted as having no effect)
                self._check_diloco()
        elif self.dp_error_feedback:
            raise ValueError("--dp-error-feedback compensates the quantization of DiLoCo's pseudo-gradients: add "
                             "--dp-sync-every H > 1 (and --dp >= 2); the per-step gradient all-reduce has no error "
                             "feedback")
        elif self.dp_sync_fragments != 1:
            raise ValueError(f"--dp-sync-fragments {self.dp_sync_fragments} cuts DiLoCo's meetings into fragments: "
                             "add --dp-sync-every H > 1 (and --dp >= 2)")
        elif self.dp_sync_overlap:
            raise ValueError(f"--dp-sync-overlap {self.dp_sync_overlap} overlaps DiLoCo's meetings with training: "
                             "add --dp-sync-every H > 1 (and --dp >= 2)")
        if self.grad_accum_bits not in (0, 8):
            raise ValueError(f"--grad-accum-bits must be 8 (or 0: off), got {self.grad_accum_bits}")
        self.split_list()
        # an unknown name or an incomplete model directory fails before any process starts, and so does a
        # mesh the model cannot be cut into
        self._check_model(model_source(self.model))
        try:
            parse_corpus_spec(self.corpus)  # so does a corpus path that does not exist
        except (OSError, ValueError) as e:
            raise ValueError(f"--corpus: {e}") from None

    def _check_diloco(self) -> None:
        """--dp-sync-every > 1 (DiLoCo): what the outer loop cannot be combined with, and its rates."""
        from qwire.codecs import parse_spec
        from qwire.comm.ddp_hooks import TORCH_HOOKS

        for flag, why in ((self.dp_shard, "--dp-shard: FSDP shards hold no whole replica to average"),
                          (self.dp_codec in TORCH_HOOKS, f"--dp-codec {self.dp_codec}: a DDP hook, and DiLoCo has "
                                                         "no DDP; name a qwire codec such as blockwise8"),
                          (parse_spec(self.dp_codec)[0] == "auto", "--dp-codec auto: it measures a gradient "
                                                                   "all-reduce at every step; name the codec")):
            if flag:
                raise ValueError(f"--dp-sync-every {self.dp_sync_every} (DiLoCo) cannot be used with {why}")
        if self.dp_sync_fragments < 1 or self.dp_sync_every % self.dp_sync_fragments:
            raise ValueError(f"--dp-sync-fragments must be >= 1 and divide --dp-sync-every ({self.dp_sync_every}), "
                             f"so that the fragments meet evenly spaced; got {self.dp_sync_fragments}")
        gap = self.dp_sync_every // self.dp_sync_fragments
        if not 0 <= self.dp_sync_overlap < gap:
            between = (f"--dp-sync-every / --dp-sync-fragments ({gap})" if self.dp_sync_fragments > 1
                       else f"--dp-sync-every ({self.dp_sync_every})")
            raise ValueError(f"--dp-sync-overlap must be >= 0 and < {between}: a meeting's outer step lands before "
                             f"the next meeting; got {self.dp_sync_overlap}")
        if not self.outer_lr > 0:
            raise ValueError(f"--outer-lr must be > 0, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"--outer-momentum must be >= 0 and < 1, got {self.outer_momentum}")

    def _check_numbers(self) -> None:
        """Counts, intervals and rates a run cannot use, each with the option to change."""
        at_least = (("steps", 1), ("seq_len", 2), ("log_every", 1), ("eval_batches", 0), ("warmup", 0),
                    ("eval_every", 0), ("checkpoint_every", 0), ("max_tokens", 0))
        for name, low in at_least:
            if getattr(self, name) < low:
                zero = {"eval_every": " (0: only at the end)", "checkpoint_every": " (0: only at the end)",
                        "max_tokens": " (0: the corpus default)", "eval_batches": " (0: no validation)"}.get(name, "")
                raise ValueError(f"--{name.replace('_', '-')} must be >= {low}{zero}, got {getattr(self, name)}")
        if not 0 < self.timeout <= MAX_WAIT_S:
            raise ValueError(f"--timeout must be > 0 seconds and at most {MAX_WAIT_S} (30 days), got {self.timeout}")
        for name in ("lr", "weight_decay", "grad_clip"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0"
                                 f"{' (0 disables it)' if name == 'grad_clip' else ''}, got {getattr(self, name)}")

    def _check_model(self, src: Any) -> None:
        """What the model's config says about this run: the vocabulary of a tokenizer qwire trains, the
        layers the stages share, and the heads tensor parallelism divides (read from the config alone)."""
        from qwire.data.tokenizer import MIN_VOCAB_SIZE
        from qwire.models import SUPPORTED_MODEL_TYPES, partition_layers
        from qwire.models.build import model_config
        from qwire.parallel.tp import TP_MODEL_TYPES, TPConfigError, check_tp_divides

        if src.tokenizer is None and self.vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(f"--vocab-size must be >= {MIN_VOCAB_SIZE} (the tokenizer qwire trains on the corpus "
                             f"is a byte-level BPE), got {self.vocab_size}")
        if src.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"--model {self.model} is a {src.model_type} model, which qwire does not train (it splits "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)} models into stages); give a model of one of those")
        config = model_config(src)
        if config is None:  # a config transformers cannot read here: building the model will say why
            return
        fields = config.to_dict()
        key = next((k for k in ("n_positions", "max_position_embeddings") if k in fields), None)
        positions = fields[key] if key else None
        if isinstance(positions, int) and self.seq_len > positions:
            raise ValueError(f"--seq-len {self.seq_len} is longer than {self.model}'s context of {positions} positions "
                             f"({key} in its config); give --seq-len {positions} or less, or a model with a longer "
                             "context")
        layers = getattr(config, "num_hidden_layers", None)
        if layers is not None:
            try:
                partition_layers(layers, self.stages, self.split_list())
            except ValueError as e:
                raise ValueError(f"--stages {self.stages}{' --split ' + self.split if self.split else ''}: {e} "
                                 f"(model {self.model})") from None
        if self.tp > 1:
            if src.model_type not in TP_MODEL_TYPES:
                raise ValueError(f"--tp {self.tp}: tensor parallelism splits Llama-style decoders "
                                 f"({', '.join(sorted(TP_MODEL_TYPES))}), and {self.model} is a "
                                 f"{src.model_type} model; use --tp 1 or one of those")
            try:
                check_tp_divides(config, self.tp)
            except TPConfigError as e:
                raise ValueError(f"--tp {self.tp}: {self.model}: {e}") from None

    @staticmethod
    def _check_flat_bytes(name: str, spec: str) -> None:
        """A collective's codec codes the flat 1-D shards the collectives send: one that sends more than bf16's
        two bytes per element there is refused (:func:`~qwire.codecs.auto.flat_bits`)."""
        from qwire.codecs import get_codec
        from qwire.codecs.auto import FLAT_ADVICE, flat_bits

        bits = flat_bits(get_codec(spec))
        if bits is not None:
            raise ValueError(f"--{name.replace('_', '-')} {spec}: the all-reduces and reduce-scatters code flat "
                             f"1-D shards, where this codec sends {bits:g} bits per element, more than bf16's 16 "
                             "(perchannel codes each column of the last dimension with its own step, and in a 1-D "
                             f"shard every element is a column); {FLAT_ADVICE}")

    def _check_pipeline_autos(self) -> None:
        """``auto`` on both directions: one controller measures the link and decides for both, so a link,
        probe_every or shift given on both must be the same (given on one, it serves both; each direction keeps
        its own candidates, max_nmse and min_gain)."""
        from qwire.codecs import CodecError, get_codec, parse_spec
        from qwire.codecs.auto import Auto, shared_option

        specs = [s for s in (self.fwd_codec, self.bwd_codec) if isinstance(get_codec(s), Auto)]
        for key in ("link", "probe_every", "shift"):
            try:
                shared_option([get_codec(s) for s in specs], key)
                # ... and a value given on both that is the default on one (link=measured against link=100mbit)
                given = {getattr(get_codec(s), key) for s in specs if key in parse_spec(s)[1]}
                if len(given) > 1:
                    raise CodecError(f"one controller measures a stage's links and decides both directions, so "
                                     f"their {key} must agree: {', '.join(sorted(f'{key}={v}' for v in given))}; "
                                     "give one value (on one direction, it serves both)")
            except CodecError as e:
                raise ValueError(f"--fwd-codec {self.fwd_codec} and --bwd-codec {self.bwd_codec}: {e}") from None

    def _check_auto(self, name: str, role: str) -> None:
        """``auto`` on a collective dimension: the role's candidates (unless given) must all take the 1-D
        shards collectives send; a DDP hook name is not a codec."""
        from qwire.codecs import CodecError
        from qwire.codecs.auto import auto_for, check_flat_candidates
        from qwire.comm.ddp_hooks import TORCH_HOOKS

        spec, opt = getattr(self, name), "--" + name.replace("_", "-")
        if not spec or spec.split(":")[0].strip().lower() != "auto":
            return
        if any(h in spec for h in TORCH_HOOKS):
            raise ValueError(f"{opt} {spec}: {', '.join(TORCH_HOOKS)} is one of PyTorch's DDP hooks, not a codec, so "
                             "it cannot be an auto candidate; name qwire codecs, e.g. candidates=fp16+blockwise8")
        try:
            codec = auto_for(spec, role)
            check_flat_candidates(codec, opt)
        except CodecError as e:
            raise ValueError(f"{opt}: {e}") from None

    def split_list(self) -> list[int] | None:
        """--split as layer counts per stage (None: an even split)."""
        if not self.split:
            return None
        try:
            parts = [int(p) for p in self.split.split(",")]
        except ValueError as e:
            raise ValueError(f"--split must be comma-separated layer counts like 3,2,2,1, got {self.split!r}") from e
        if len(parts) != self.stages:
            raise ValueError(f"--split gives {len(parts)} stages but --stages is {self.stages}")
        return parts

    def resolve_backend(self, local_world: int) -> str:
        """The transport of a rank whose machine runs ``local_world`` ranks (see ``--backend``), as far as the
        rank can tell alone: ``auto`` on CUDA takes nccl if the rank sees a GPU per local rank. Where the ranks
        share a store (qwire's launchers, torchrun), ``init_process_group`` decides ``auto`` from every rank's
        GPU instead (:func:`qwire.rendezvous.gpu_backend`)."""
        import torch

        if self.backend != "auto":
            return self.backend
        if self.device != "cuda":
            return "gloo"
        return "nccl" if torch.cuda.device_count() >= local_world else "gloo"

    def describe(self) -> str:
        """The mesh in words: ``4 stages x TP 2 (fp8) x DP 2 (blockwise8:block=256)``."""
        dp = ""
        if self.dp > 1:
            dp = f" x DP {self.dp} ({'FSDP, gradients ' if self.dp_shard else ''}{self.dp_codec}"
            if self.dp_shard:
                dp += f", weights {self.dp_param_codec or 'fp32'}" + (" kept for the step" if self.dp_keep_weights
                                                                      else "")
            if self.dp_sync_every > 1:
                f = self.dp_sync_fragments
                dp += (f", DiLoCo: meeting every {self.dp_sync_every} steps"
                       + (f" in {f} fragments, one every {self.dp_sync_every // f}" if f > 1 else "")
                       + (f", landing {self.dp_sync_overlap} later" if self.dp_sync_overlap else "")
                       + (", error feedback" if self.dp_error_feedback else ""))
            dp += ")"
        return (f"{self.stages} stage{'s' if self.stages != 1 else ''}"
                + (f" x TP {self.tp} ({self.tp_codec})" if self.tp > 1 else "") + dp)


def field_help() -> dict[str, str]:
    """Each option's help text, by field name."""
    return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(TrainConfig)}


def load_config_file(path: str | Path, what: str = "--config") -> dict[str, Any]:
    """Options from a JSON or TOML file, checked against TrainConfig's fields and types; errors start with
    ``what`` (the option that named the file)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{what}: {path} not found")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        why = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else (e.strerror or str(e))
        raise ValueError(f"{what}: {path} cannot be read as a JSON or TOML file of options ({why})") from None
    toml = path.suffix.lower() == ".toml"
    try:
        if toml:
            import tomllib  # only for TOML files
            raw = tomllib.loads(text)
        else:
            raw = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{what}: {path} is not valid {'TOML' if toml else 'JSON'}: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{what}: {path} must hold a table/object of options")
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    defaults = TrainConfig()
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        name = "stages" if name == "pp" else name
        if name not in fields:
            raise ValueError(f"{what}: unknown option {key!r} in {path}; options are "
                             f"{', '.join(sorted(fields))}")
        want = type(getattr(defaults, name))
        if want is int and isinstance(value, bool) or want is bool and not isinstance(value, bool):
            raise ValueError(f"{what}: {key} must be {want.__name__}, got {value!r} in {path}")
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise ValueError(f"{what}: {key} must be {want.__name__}, got {value!r} in {path}")
        out[name] = value
    return out


def _pinned(cfg: TrainConfig, field: str, nested: bool = True) -> str | None:
    """:func:`~qwire.codecs.pin_spec` of codec option ``field``; a bare ``auto`` with the candidates of the
    dimension it serves (:data:`~qwire.codecs.auto.ROLE_CANDIDATES`: a data-parallel ``auto`` is not the
    pipeline's)."""
    from qwire.codecs import parse_spec, pin_spec
    from qwire.codecs.auto import ROLE_CANDIDATES

    spec = getattr(cfg, field)
    name, opts = parse_spec(spec)
    if name == "auto" and "candidates" not in opts:
        sep = "," if ":" in spec else ":"
        spec += f"{sep}candidates={ROLE_CANDIDATES[CODEC_ROLES[field]]}"
    return pin_spec(spec, nested)


def codec_pins(cfg: TrainConfig) -> dict[str, str]:
    """Each codec option of ``cfg`` with every parameter written out (:func:`~qwire.codecs.pin_spec`; the codecs
    named inside one too, marked by ``NESTED_PINS``), where it names one codec: what a run directory's
    ``codecs.json`` holds."""
    pins = {f: _pinned(cfg, f) for f in CODEC_FIELDS if getattr(cfg, f)}
    return {**{f: p for f, p in pins.items() if p is not None}, **NESTED_PINS}


def _spec_change(now: str | None, then: str) -> str:
    """What ``now`` builds where the pinned ``then`` differs: ``"layout=log6t (the run: layout=log7)"``."""
    from qwire.codecs import parse_spec

    if now is None:
        return "no codec spec that pins it"
    (n_name, n), (t_name, t) = parse_spec(now), parse_spec(then)
    if n_name != t_name:
        return f"{n_name} (the run: {t_name})"
    keys = [k for k in {**n, **t} if n.get(k) != t.get(k)]
    mine = ",".join(f"{k}={n[k]}" for k in keys if k in n) or "no " + ",".join(keys)
    return f"{mine} (the run: {','.join(f'{k}={t[k]}' for k in keys if k in t) or 'no ' + ','.join(keys)})"


def with_pinned_codecs(cfg: TrainConfig, pins: dict[str, str], what: str = "--resume") -> tuple[TrainConfig, list[str]]:
    """``cfg`` with each codec option whose spec no longer builds the codec ``pins`` (:func:`codec_pins` of the
    run's start, perhaps by an earlier version) replaced by the spec that does, and a note for each; raises
    ValueError (starting with ``what``) for a pinned codec this version cannot build."""
    from qwire.codecs import CodecError, unpin_spec

    notes, changes = [], {}
    nested = all(pins.get(k) == v for k, v in NESTED_PINS.items())  # else written before nested codecs were pinned
    for f, pin in pins.items():
        if f not in CODEC_FIELDS or not getattr(cfg, f):
            continue
        if not nested and CODEC_ROLES[f] != "pipeline" and pin.split(":")[0].strip().lower() == "auto":
            continue  # pinned then with the pipeline's candidates, not those the dimension ran with
        now = _pinned(cfg, f, nested)
        if now == pin:
            continue
        option = "--" + f.replace("_", "-")
        try:
            spec = unpin_spec(pin, nested)
        except CodecError as e:
            raise ValueError(f"{what}: the run started with {option} {pin} ({CODEC_PINS} of its run directory), which "
                             f"this version of qwire cannot build: {e}; continue it with the version that started it, "
                             "or start a new run") from None
        if spec == now:
            continue
        changes[f] = spec
        notes.append(f"{what}: {option} {getattr(cfg, f)} builds {_spec_change(now, spec)} in this version of "
                     f"qwire; continuing with the run's codec ({CODEC_PINS}): {spec}")
    return (dataclasses.replace(cfg, **changes) if changes else cfg), notes
