"""Zoo models built from transformers configs (random init, no downloads): the CNNs, vision
transformers and language models that the Coop and OLLA papers report.

Every builder makes its tensors on the current default device with the default dtype, so it
works for real, under ``with torch.device("meta")`` and under ``FakeTensorMode`` (build inside
the mode). Attention uses ``sdpa``, what a GPU user runs, and no attention mask is passed: all
tokens are real, and an all-ones mask would make transformers skip it in a real run but
materialize a (batch, 1, seq, seq) mask under fake tensors (it cannot read their values) and
fail on meta ones (``mask.all()``), so the three runs would differ.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor
from transformers import (
    BertConfig,
    BertForMaskedLM,
    EfficientNetConfig,
    EfficientNetForImageClassification,
    GPT2Config,
    GPT2LMHeadModel,
    MobileNetV2Config,
    MobileNetV2ForImageClassification,
    PreTrainedConfig,
    PreTrainedModel,
    ResNetConfig,
    ResNetForImageClassification,
    SwinConfig,
    SwinForImageClassification,
    ViTConfig,
    ViTForImageClassification,
    XLMRobertaConfig,
    XLMRobertaForMaskedLM,
)
from transformers.initialization import no_init_weights

from membudget.models.zoo import Workload, ZooModel, register

IMAGE_SIZE = 224
IMAGENET_CLASSES = 1000
ATTENTION = "sdpa"


def _instantiate(model_class: type[PreTrainedModel], config: PreTrainedConfig) -> PreTrainedModel:
    """``model_class(config)`` in train mode with its random init run once: torch's per-layer
    default init is skipped and transformers' own init runs afterwards, only on real tensors."""
    with no_init_weights():
        model = model_class(config)
    if _holds_data(next(model.parameters())):
        model.init_weights()  # initializes, then ties the output embedding to the input one
    else:
        # Meta and fake tensors have no values to initialize, and torch's trunc_normal_ (ViT)
        # loops on ``mask.any()``, which fake tensors cannot answer.
        model.tie_weights()
    return model.train()


def _holds_data(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` has values: meta and fake tensors only have shapes."""
    return not (tensor.is_meta or isinstance(tensor, FakeTensor))


def _loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The loss the transformers model computes itself when the batch carries ``labels``."""
    return model(**batch).loss


def _image_classifier(
    model_class: type[PreTrainedModel], config: PreTrainedConfig, batch: int
) -> Workload:
    """ImageNet classification: random 224×224 RGB images with random labels out of 1000."""
    model = _instantiate(model_class, config)
    images = torch.randn(batch, config.num_channels, IMAGE_SIZE, IMAGE_SIZE)
    labels = torch.randint(IMAGENET_CLASSES, (batch,))
    return Workload(model, {"pixel_values": images, "labels": labels}, _loss)


def _language_model(model: PreTrainedModel, batch: int, seq: int) -> Workload:
    """Random token ids that are also the labels: a causal LM shifts them to predict the next
    token; a masked LM predicts every position (its head scores all positions anyway, so this
    costs what BERT's 15% masking does)."""
    ids = torch.randint(model.config.vocab_size, (batch, seq))
    return Workload(model, {"input_ids": ids, "labels": ids}, _loss)


def _gpt(config: GPT2Config, batch: int, seq: int) -> Workload:
    """A GPT-2-architecture causal LM (output embedding tied to the input one)."""
    model = _instantiate(GPT2LMHeadModel, config)
    model.loss_type = "ForCausalLM"  # transformers cannot tell it from the class name
    return _language_model(model, batch, seq)


def build_resnet50(batch: int) -> Workload:
    """ResNet-50 (transformers' ResNetConfig defaults) classifying 224×224 images."""
    return _image_classifier(
        ResNetForImageClassification, ResNetConfig(num_labels=IMAGENET_CLASSES), batch
    )


def build_swin_t(batch: int) -> Workload:
    """Swin-T (SwinConfig defaults: swin-tiny, patch 4, window 7) classifying 224×224 images."""
    config = SwinConfig(num_labels=IMAGENET_CLASSES, attn_implementation=ATTENTION)
    return _image_classifier(SwinForImageClassification, config, batch)


def build_mobilenet_v2(batch: int) -> Workload:
    """MobileNet-V2 1.0 (MobileNetV2Config defaults) classifying 224×224 images."""
    return _image_classifier(
        MobileNetV2ForImageClassification, MobileNetV2Config(num_labels=IMAGENET_CLASSES), batch
    )


def build_efficientnet_b0(batch: int) -> Workload:
    """EfficientNet-B0, as google/efficientnet-b0 sets it: EfficientNetConfig's defaults are B7,
    so width and depth 1.0, a 1280-channel head and dropout 0.2."""
    config = EfficientNetConfig(
        num_labels=IMAGENET_CLASSES, image_size=IMAGE_SIZE, width_coefficient=1.0,
        depth_coefficient=1.0, hidden_dim=1280, dropout_rate=0.2,
    )
    return _image_classifier(EfficientNetForImageClassification, config, batch)


def build_vit_b16(batch: int) -> Workload:
    """ViT-B/16 (ViTConfig defaults: 12 layers, hidden 768, patch 16) on 224×224 images."""
    config = ViTConfig(num_labels=IMAGENET_CLASSES, attn_implementation=ATTENTION)
    return _image_classifier(ViTForImageClassification, config, batch)


GPT2_SEQ = 512


def build_gpt2(batch: int) -> Workload:
    """GPT-2 small (GPT2Config defaults, 124M) on 512-token sequences."""
    return _gpt(GPT2Config(attn_implementation=ATTENTION), batch, GPT2_SEQ)


GPT3_SEQ = 1024
GPT3_LAYERS = 32


def build_gpt3(batch: int, n_layer: int = GPT3_LAYERS) -> Workload:
    """GPT-3 2.7B's shape (32 layers, hidden 2560, 32 heads, 2048 positions) on the GPT-2
    architecture, on 1024-token sequences. ``n_layer`` shrinks it only so that tests can run
    it for real: the full model's parameters, gradients and Adam state exceed this machine."""
    config = GPT2Config(
        n_layer=n_layer, n_embd=2560, n_head=32, n_positions=2048,
        attn_implementation=ATTENTION,
    )
    return _gpt(config, batch, GPT3_SEQ)


BERT_SEQ = 512


def build_bert_large(batch: int) -> Workload:
    """BERT-Large (24 layers, hidden 1024, 16 heads, FFN 4096) masked LM on 512 tokens."""
    config = BertConfig(
        num_hidden_layers=24, hidden_size=1024, num_attention_heads=16, intermediate_size=4096,
        attn_implementation=ATTENTION,
    )
    return _language_model(_instantiate(BertForMaskedLM, config), batch, BERT_SEQ)


XLMR_SEQ = 128


def build_xlm_r_base(batch: int) -> Workload:
    """XLM-R base masked LM on 128 tokens: XLMRobertaConfig's defaults are BERT-base's, so the
    250002-token vocabulary and the rest of FacebookAI/xlm-roberta-base's settings are set."""
    config = XLMRobertaConfig(
        vocab_size=250002, max_position_embeddings=514, type_vocab_size=1, layer_norm_eps=1e-5,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, attn_implementation=ATTENTION,
    )
    return _language_model(_instantiate(XLMRobertaForMaskedLM, config), batch, XLMR_SEQ)


OLLA_BATCH = "OLLA reports batch 1 and 32; default 32"

register(ZooModel(
    "resnet-50", build_resnet50, batch=115, small_batch=4, paper="Coop",
    description="ResNet-50 (transformers ResNetConfig defaults), 3×224×224, 1000 classes; "
                "Coop's batch 115"))
register(ZooModel(
    "swin-t", build_swin_t, batch=40, small_batch=2, paper="Coop",
    description="Swin-T (SwinConfig defaults: patch 4, window 7, depths 2/2/6/2), 3×224×224, "
                "1000 classes; Coop's batch 40"))
register(ZooModel(
    "gpt2", build_gpt2, batch=8, small_batch=1, paper="Coop",
    description="GPT-2 small causal LM (GPT2Config defaults, 124M), 512 tokens; Coop's batch 8"))
register(ZooModel(
    "bert-large", build_bert_large, batch=16, small_batch=1, paper="Coop",
    description="BERT-Large masked LM (24 layers, hidden 1024, 16 heads, FFN 4096, tied "
                "decoder), 512 tokens, every position predicted; Coop's batch 16"))
register(ZooModel(
    "gpt3-2.7b", build_gpt3, batch=2, small_batch=1, paper="Coop",
    description="GPT-3 2.7B's shape (32 layers, hidden 2560, 32 heads, 2048 positions, vocabulary "
                "50257) on the GPT-2 architecture, dense attention in every layer (GPT-3 "
                "alternates dense and banded sparse), 1024 tokens; batch 2 because "
                "Coop's LiBai run used micro-batch 2. Too big to train here: build it on the meta "
                "device or under FakeTensorMode"))
register(ZooModel(
    "mobilenet-v2", build_mobilenet_v2, batch=32, small_batch=8, paper="OLLA",
    description="MobileNet-V2 1.0 (MobileNetV2Config defaults), 3×224×224, 1000 classes; "
                f"{OLLA_BATCH}"))
register(ZooModel(
    "efficientnet-b0", build_efficientnet_b0, batch=32, small_batch=8, paper="OLLA",
    description="EfficientNet-B0 (google/efficientnet-b0's config), 3×224×224, 1000 classes; "
                f"{OLLA_BATCH}"))
register(ZooModel(
    "vit-b16", build_vit_b16, batch=32, small_batch=2, paper="OLLA",
    description=f"ViT-B/16 (ViTConfig defaults), 3×224×224, 1000 classes; {OLLA_BATCH}"))
register(ZooModel(
    "xlm-r-base", build_xlm_r_base, batch=32, small_batch=1, paper="OLLA",
    description="XLM-R base masked LM (vocabulary 250002, tied decoder), 128 tokens (our "
                f"choice), every position predicted; {OLLA_BATCH}"))
