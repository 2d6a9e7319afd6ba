"""The variants benchmarks/sst2_accuracy.py runs: each a shipped pipelines/sst2_minilm_*.yaml,
its overrides (`--set` lines) and seeds; every recipe tried on SST-2's dev split is listed
here, so each row of RESULTS.md's table can be rerun."""

from __future__ import annotations

EPS1, EPS3, EPS8 = (["privacy.target_epsilon=1"], ["privacy.target_epsilon=3"],
                    ["privacy.target_epsilon=8"])
SEEDS3, SEED1 = (0, 1, 2), (0,)
# Every encoder layer + head (the embeddings frozen), no prefix to cache, 8 epochs.
ALL_LAYERS = ["model.trainable={last_k_layers: 6}", "training.cache_frozen_prefix=false",
              "training.epochs=8"]
TRIM = ["training.trim_padding=true"]
# The DP-SGD and LSG pipelines on the last layer + head (the frozen prefix cached), 20 epochs,
# the new head at lr 1.0: the last-layer recipes (DP-LoRA's adds LORA_R16).
LAST_LAYER = ["model.trainable={last_k_layers: 1}", "training.cache_frozen_prefix=true",
              "training.epochs=20", "model.head_init=default", "model.label_texts=null",
              "training.trim_padding=false", 'training.param_groups=[{params: ["classifier.*"], lr: 1.0}]']
LORA_R8 = ["privacy.lora.rank=8", "privacy.lora.alpha=16"]
LORA_R16 = ["privacy.lora.rank=16", "privacy.lora.alpha=32"]
# AdamW as Yu et al. train DP-LoRA: lr 1e-3, the new head's 1e-2.
ADAMW = ["training.optimizer=adamw", "training.momentum=0", "training.lr=1e-3",
         "training.param_groups[0].lr=1e-2"]
# The head starts as a zero-shot classifier (texts chosen on dev among 5 pairs: 0.72 there).
LABEL_HEAD = ["model.head_init=label_texts",
              "model.label_texts=[I hated this movie, I loved this movie]"]
# Rank-4 adapters on every layer's query and value only (Hu et al.'s placement): 37,634
# numbers trained, a ninth of lora-all's, so a third of its noise norm per step.
QV_AND_HEAD = '["*attention.self.query.*", "*attention.self.value.*", "classifier.*"]'
LORA_QV = [f"model.trainable={QV_AND_HEAD}", "training.cache_frozen_prefix=false",
           "training.epochs=8", "privacy.lora.rank=4", "privacy.lora.alpha=8",
           'privacy.lora.layers=["*query", "*value"]']
FULL_FT = ["model.trainable=all", "training.cache_frozen_prefix=false", "training.batch_size=32",
           "training.max_physical_batch=32", "training.epochs=3"]
# name: (pipeline, overrides, seeds)
VARIANTS = {
    "non-private-last": ("sst2_minilm_nonprivate.yaml", [], SEED1),
    "probe-eps3": ("sst2_minilm_probe.yaml", EPS3, SEEDS3),
    "probe-eps8": ("sst2_minilm_probe.yaml", EPS8, SEED1),
    "dpsgd-eps3": ("sst2_minilm_dpsgd.yaml", EPS3, SEEDS3),
    "dpsgd-eps8": ("sst2_minilm_dpsgd.yaml", EPS8, SEEDS3),
    # The last-layer recipes (every row below of these pipelines starts from them).
    "dpsgd-last-eps3": ("sst2_minilm_dpsgd.yaml", EPS3, SEEDS3),
    "dpsgd-last-eps8": ("sst2_minilm_dpsgd.yaml", EPS8, SEED1),
    "lsg-eps3": ("sst2_minilm_lsg.yaml", EPS3, SEEDS3),
    "lsg-last-eps3": ("sst2_minilm_lsg.yaml", EPS3, SEEDS3),
    "lsg-last-eps8": ("sst2_minilm_lsg.yaml", EPS8, SEED1),
    "lora-eps3": ("sst2_minilm_lora.yaml", EPS3, SEEDS3),
    "lora-last-eps3": ("sst2_minilm_lora.yaml", EPS3, SEEDS3),
    "lora-last-eps8": ("sst2_minilm_lora.yaml", EPS8, SEED1),
    # DP-LoRA on a bf16 frozen base: seed 2 is lora-last-eps3's LoraLinear seed, its fp32 twin.
    "lora-last-bf16-eps3": ("sst2_minilm_lora.yaml", [*EPS3, "model.frozen_dtype=bf16"], (2,)),
    "probe-eps1": ("sst2_minilm_probe.yaml", EPS1, SEED1),
    "lora-last-eps1": ("sst2_minilm_lora.yaml", EPS1, SEED1),
    # Recipes tried on dev: adapters or DP-SGD on every layer.
    "lora-all-eps3": ("sst2_minilm_lora.yaml",
                      [*EPS3, *ALL_LAYERS, *LORA_R8], SEED1),
    "lora-all-adamw-eps3": ("sst2_minilm_lora.yaml",
                            [*EPS3, *ALL_LAYERS, *LORA_R8, *ADAMW], SEED1),
    "lora-all-label-eps3": ("sst2_minilm_lora.yaml",
                            [*EPS3, *ALL_LAYERS, *LORA_R8, *LABEL_HEAD], SEED1),
    # ... the label-text head at the adapters' lr (it starts trained), and smaller expected
    # batches (more steps for the same epochs and time) at lower lrs.
    **{f"lora-all-label-b{batch}-lr{lr}-eps3": (
        "sst2_minilm_lora.yaml", [*EPS3, *ALL_LAYERS, *LORA_R8, *LABEL_HEAD, *TRIM,
                                  f"training.batch_size={batch}", f"training.lr={lr}",
                                  f"training.param_groups[0].lr={lr}"], SEED1)
       for batch, lr in ((1024, 0.3), (512, 0.3), (256, 0.15), (1024, 0.6))},
    "lora-all-label-b512-lr0.3-linear-eps3": (
        "sst2_minilm_lora.yaml", [*EPS3, *ALL_LAYERS, *LORA_R8, *LABEL_HEAD, *TRIM,
                                  "training.batch_size=512", "training.lr=0.3",
                                  "training.param_groups[0].lr=0.3", "training.schedule=linear"],
        SEED1),
    # The adapters' A matrices kept at their random start (a learning rate of 1e-9; FFA-LoRA,
    # Sun et al. 2024): the noise then enters the update B A through B alone, not also as
    # the product of two noisy matrices.
    **{f"lora-all-label-b{batch}-lr{lr}-frozen-a-eps3": (
        "sst2_minilm_lora.yaml", [*EPS3, *ALL_LAYERS, *LORA_R8, *LABEL_HEAD, *TRIM,
                                  f"training.batch_size={batch}", f"training.lr={lr}",
                                  (f"training.param_groups=[{{params: [classifier.*], lr: {lr}}}, "
                                   "{params: ['*lora_A'], lr: 1e-9}]")], SEED1)
       for batch, lr in ((1024, 0.3), (512, 0.3), (1024, 0.6))},
    # The epsilon-3 choice on dev at epsilon 8 and 1.
    **{f"lora-all-label-lr0.3-eps{eps}": (
        "sst2_minilm_lora.yaml", [f"privacy.target_epsilon={eps}", *ALL_LAYERS, *LORA_R8,
                                  *LABEL_HEAD, *TRIM, "training.lr=0.3",
                                  "training.param_groups[0].lr=0.3"], SEED1)
       for eps in (8, 1)},
    # The dev choice without noise (clipped at C only): how far its 54 steps can go at all.
    "lora-all-label-lr0.3-noiseless": (
        "sst2_minilm_lora.yaml", ["privacy.target_epsilon=null", "privacy.noise_multiplier=0.001",
                                  *ALL_LAYERS, *LORA_R8, *LABEL_HEAD, *TRIM, "training.lr=0.3",
                                  "training.param_groups[0].lr=0.3"], SEED1),
    "lora-qv-label-eps3": ("sst2_minilm_lora.yaml", [*EPS3, *LORA_QV, *LABEL_HEAD], SEED1),
    "dpsgd-all-eps3": ("sst2_minilm_dpsgd.yaml", [*EPS3, *ALL_LAYERS], SEED1),
    # DP-SGD on every layer with the label-text head, all at the pretrained layers' lr.
    "dpsgd-all-label-eps3": ("sst2_minilm_dpsgd.yaml",
                             [*EPS3, *ALL_LAYERS, *LABEL_HEAD, *TRIM,
                              "training.param_groups[0].lr=0.1"], SEED1),
    **{f"dpsgd-all-label-lr{lr}-eps{eps}": (
        "sst2_minilm_dpsgd.yaml", [f"privacy.target_epsilon={eps}", *ALL_LAYERS, *LABEL_HEAD,
                                   *TRIM, f"training.lr={lr}", f"training.param_groups[0].lr={lr}"],
        SEED1)
       for lr, eps in ((0.2, 3), (0.1, 8))},
    # ... twice the epochs (108 steps, sigma 2.541): epsilon 8 read like epsilon 3 after
    # every epoch, so the steps, not the noise, held it back.
    "dpsgd-all-label-e16-eps3": (
        "sst2_minilm_dpsgd.yaml", [*EPS3, *ALL_LAYERS, *LABEL_HEAD, *TRIM,
                                   "training.param_groups[0].lr=0.1", "training.epochs=16"],
        SEED1),
    # ... with sigma calibrated by PLD (7% less noise than RDP's at the same epsilon).
    "dpsgd-all-label-lr0.1-pld-eps1": (
        "sst2_minilm_dpsgd.yaml", [*EPS1, "privacy.accountant=pld", *ALL_LAYERS, *LABEL_HEAD,
                                   *TRIM, "training.param_groups[0].lr=0.1"], SEED1),
    # ... decaying linearly from lr 0.2 (which rose faster than 0.1 and ended lower); with
    # Adam at Li et al.'s lr for full private fine-tuning.
    "dpsgd-all-label-lr0.2-linear-eps3": (
        "sst2_minilm_dpsgd.yaml", [*EPS3, *ALL_LAYERS, *LABEL_HEAD, *TRIM, "training.lr=0.2",
                                   "training.param_groups[0].lr=0.2", "training.schedule=linear"],
        SEED1),
    "dpsgd-all-label-adamw-lr5e-4-eps3": (
        "sst2_minilm_dpsgd.yaml", [*EPS3, *ALL_LAYERS, *LABEL_HEAD, *TRIM,
                                   "training.optimizer=adamw", "training.momentum=0",
                                   "training.lr=5e-4", "training.param_groups[0].lr=5e-4"],
        SEED1),
    # LSG on the same trainable set as dpsgd-all-label (its rank-16 carriers on every layer).
    "lsg-all-label-eps3": ("sst2_minilm_lsg.yaml",
                           [*EPS3, *ALL_LAYERS, *LABEL_HEAD, *TRIM, "training.lr=0.3",
                            "training.param_groups[0].lr=0.3"], SEED1),
    # The honest reference: every layer trained without privacy, its lr searched on dev (one
    # seed each); the chosen lr is sst2_minilm_full_nonprivate.yaml's, run on 3 seeds (its seed
    # 0 is the search's run at that lr: the same configuration).
    "full-nonprivate": ("sst2_minilm_full_nonprivate.yaml", [], SEEDS3),
    **{f"full-ft-lr{lr}": ("sst2_minilm_nonprivate.yaml", [*FULL_FT, f"training.lr={lr}"], SEED1)
       for lr in ("2e-5", "5e-5", "1e-4")},
}
# The shipped DP-SGD recipe clips at C 10 with lr 0.01, with PLD's sigma and dropout off; it
# was first run at C 1 and lr 0.1, then at C 10 with RDP's sigma and the model's dropout (0.1).
# Every example's gradient norm starts between 4 and 57 (median 16), so at C 1 each is cut
# to 1 and a fitted example pulls as hard as a wrong one; at C 10 the noise on the weights
# (lr sigma C / B) is the same, and gradients below 10 keep their size.
C1 = ["privacy.clip_norm=1", "training.lr=0.1"]
RDP_DROPOUT = ["privacy.accountant=rdp", "model.dropout=null"]
PLD_DROPOUT = ["privacy.accountant=pld", "model.dropout=null"]
LSG_C1 = ["privacy.clip_norm=1", "training.lr=0.3"]
FROM_SHIPPED = {
    "dpsgd-c1-eps3": ("sst2_minilm_dpsgd.yaml", [*EPS3, *RDP_DROPOUT, *C1], SEEDS3),
    "dpsgd-c1-eps8": ("sst2_minilm_dpsgd.yaml", [*EPS8, *RDP_DROPOUT, *C1], SEEDS3),
    # The C 10 recipe with RDP's sigma and the model's dropout; then each change to it ...
    "dpsgd-c10-eps3": ("sst2_minilm_dpsgd.yaml", [*EPS3, *RDP_DROPOUT], SEEDS3),
    # ... with dropout off: its masks add a second noise to each clipped gradient (the shipped
    # pipeline has it off and takes PLD's sigma: 1.815 instead of RDP's 1.953 at epsilon 3).
    "dpsgd-nodrop-eps3": ("sst2_minilm_dpsgd.yaml", [*EPS3, *RDP_DROPOUT, "model.dropout=0"],
                          SEED1),
    # ... at epsilon 8 at twice the lr: sigma is 1.05 there, not 1.95, so lr sigma C / B
    # stays near epsilon 3's and each step moves twice as far (epsilon 8 read like epsilon
    # 3 at C 1 and lr 0.1 after every epoch: the noise was not what held it back).
    "dpsgd-lr0.02-eps8": ("sst2_minilm_dpsgd.yaml", [*EPS8, *RDP_DROPOUT, "training.lr=0.02"],
                          SEEDS3),
    # ... at epsilon 1 with PLD's sigma (4.30 for 8 epochs), and in 5 epochs (33 steps, sigma
    # 3.48): in 8 epochs dev peaked after epoch 5 and fell after, so the last 3 epochs' noise
    # cost more than they add.
    "dpsgd-pld-eps1": ("sst2_minilm_dpsgd.yaml", [*EPS1, *PLD_DROPOUT], SEEDS3),
    "dpsgd-pld-e5-eps1": (
        "sst2_minilm_dpsgd.yaml", [*EPS1, *PLD_DROPOUT, "training.epochs=5"], SEEDS3),
    # The shipped pipeline's epsilon-1 recipe (its PLD sigma, dropout off) in 5 epochs.
    "dpsgd-e5-eps1": ("sst2_minilm_dpsgd.yaml", [*EPS1, "training.epochs=5"], SEEDS3),
    # The shipped recipe at 1.5 times the lr: its dev accuracy rose by 0.7 to 1.7 points over
    # its last 3 epochs on every seed.
    "dpsgd-lr0.015-eps3": ("sst2_minilm_dpsgd.yaml", [*EPS3, "training.lr=0.015"], SEEDS3),
    # The shipped recipe read through a moving average of its weights (decay 0.9: about the
    # last 10 of its 54 steps), the same steps: the average keeps what they share.
    "dpsgd-ema0.9-eps3": ("sst2_minilm_dpsgd.yaml", [*EPS3, "training.ema_decay=0.9"], SEEDS3),
    # The shipped recipe at twice the expected batch (sigma / B at epsilon 3 by PLD: 1.77e-3
    # at 1,024 and 54 steps, 1.18e-3 at 2,048 and 27, 1.58e-3 at 2,048 and 54): in the same 8
    # epochs at twice the lr (lr times steps stays 0.54; the same time), or in 16 epochs, the
    # same 54 steps at the same lr with 11% less noise (twice the time).
    "dpsgd-b2048-lr0.02-eps3": ("sst2_minilm_dpsgd.yaml", [
        *EPS3, "training.batch_size=2048", "training.lr=0.02"], SEEDS3),
    "dpsgd-b2048-e16-eps3": ("sst2_minilm_dpsgd.yaml", [
        *EPS3, "training.batch_size=2048", "training.epochs=16"], SEEDS3),
    # The shipped LSG pipeline clips as DP-SGD does, at C 10 with lr 0.03; it was first run at
    # C 1 with ten times the lr (the same noise on the weights).
    "lsg-c1-eps3": ("sst2_minilm_lsg.yaml", [*EPS3, *LSG_C1], SEEDS3),
}
# The shipped recipes: each pipeline as it is, and FROM_SHIPPED. Every other row of these
# three pipelines was run on top of the earlier last-layer recipes, so its overrides start
# from them.
SHIPPED = {"dpsgd-eps3", "dpsgd-eps8", "lsg-eps3", "lora-eps3",
           *FROM_SHIPPED}
VARIANTS.update(FROM_SHIPPED)
EARLIER = {"sst2_minilm_dpsgd.yaml": [*RDP_DROPOUT, *C1, *LAST_LAYER],
           "sst2_minilm_lsg.yaml": [*LSG_C1, *LAST_LAYER],
           "sst2_minilm_lora.yaml": [*LAST_LAYER, *LORA_R16]}
VARIANTS.update({name: (pipeline, [*EARLIER[pipeline], *overrides], seeds)
                 for name, (pipeline, overrides, seeds) in VARIANTS.items()
                 if name not in SHIPPED and pipeline in EARLIER})
