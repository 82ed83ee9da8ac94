"""Zoo models built from our own modules, where transformers has none: each builder makes the
model, a random batch (on the default device) and its loss, and the entries below register them."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from torch import nn

from membudget.models.densenet import DenseNet121
from membudget.models.inception import GoogLeNet, InceptionV3
from membudget.models.nas import SPOSSupernet
from membudget.models.plain_cnns import VGG16, AlexNet
from membudget.models.recurrent import BiLSTMClassifier, LSTMLanguageModel
from membudget.models.resnets import R3D18, CifarResNet
from membudget.models.seq2seq import TransformerSeq2Seq
from membudget.models.treelstm import ChildSumTreeLSTM, TreeBatch, random_tree
from membudget.models.unet import UNet
from membudget.models.zoo import Workload, ZooModel, register


def classification_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of ``model(x)`` against labels ``y``; class scores are on dim 1 (so
    per-pixel scores (N, C, H, W) against (N, H, W) labels work too)."""
    x, y = batch
    return F.cross_entropy(model(x), y)


def token_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Cross-entropy of per-token logits ``model(*inputs)`` (N, T, V) against targets (N, T)."""
    *inputs, targets = batch
    logits = model(*inputs)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def tree_loss(model: nn.Module, batch: TreeBatch) -> torch.Tensor:
    """Cross-entropy of the TreeLSTM's root classification."""
    return F.cross_entropy(model(batch.tree, batch.leaves), batch.labels)


def classification(model: nn.Module, batch: int, shape: tuple[int, ...],
                   classes: int) -> Workload:
    """A classifier fed ``batch`` random inputs of ``shape`` with random labels."""
    x = torch.randn(batch, *shape)
    return Workload(model, (x, torch.randint(0, classes, (batch,))), classification_loss)


def build_inception_v3(batch: int) -> Workload:
    """ImageNet Inception-v3 at 299×299."""
    return classification(InceptionV3(), batch, (3, 299, 299), 1000)


def build_unet(batch: int, height: int = 460, width: int = 608) -> Workload:
    """U-Net with a 2-class label per pixel; Coop's input is 460×608 (not multiples of 16)."""
    x = torch.randn(batch, 3, height, width)
    return Workload(UNet(classes=2), (x, torch.randint(0, 2, (batch, height, width))),
                    classification_loss)


def build_bilstm(batch: int, steps: int = 128) -> Workload:
    """Coop's BiLSTM classifying ``steps`` vectors of 100 features into 2 classes."""
    return classification(BiLSTMClassifier(100, 256, classes=2), batch, (steps, 100), 2)


def build_spos_supernet(batch: int, seed: int = 0) -> Workload:
    """The SPOS supernet, its paths drawn from ``random.Random(seed)``, on 224×224 images."""
    return classification(SPOSSupernet(seed=seed), batch, (3, 224, 224), 1000)


def build_cifar_resnet(batch: int, n: int = 200) -> Workload:
    """CIFAR ResNet-(6n+2); the default n=200 is ResNet-1202."""
    return classification(CifarResNet(n), batch, (3, 32, 32), 10)


def build_densenet_121(batch: int) -> Workload:
    """ImageNet DenseNet-121 at 224×224."""
    return classification(DenseNet121(), batch, (3, 224, 224), 1000)


def build_transformer(batch: int, length: int = 128, vocab: int = 32000) -> Workload:
    """Transformer base translating ``length`` source tokens into ``length`` target tokens
    (teacher forcing: the decoder reads the target, shifted by the data pipeline)."""
    source = torch.randint(0, vocab, (batch, length))
    target = torch.randint(0, vocab, (batch, length))
    labels = torch.randint(0, vocab, (batch, length))
    return Workload(TransformerSeq2Seq(vocab), (source, target, labels), token_loss)


def build_lstm_lm(batch: int, steps: int = 128, vocab: int = 10000) -> Workload:
    """LSTM language model with DTR's LSTM sizes (input 512, hidden 1700, 128 steps)."""
    tokens = torch.randint(0, vocab, (batch, steps))
    targets = torch.randint(0, vocab, (batch, steps))
    return Workload(LSTMLanguageModel(vocab, 512, 1700), (tokens, targets), token_loss)


def build_treelstm(batch: int, seed: int = 0) -> Workload:
    """TreeLSTM (input 100, memory 300, as DTR) over a random binary tree of 48–80 leaves drawn
    from ``random.Random(seed)``; ``batch`` sentences share the tree."""
    rng = random.Random(seed)
    leaves = rng.randint(48, 80)
    data = TreeBatch(random_tree(rng, leaves), [torch.randn(batch, 100) for _ in range(leaves)],
                     torch.randint(0, 5, (batch,)))
    return Workload(ChildSumTreeLSTM(100, 300, classes=5), data, tree_loss)


def build_alexnet(batch: int) -> Workload:
    """ImageNet AlexNet at 224×224."""
    return classification(AlexNet(), batch, (3, 224, 224), 1000)


def build_vgg16(batch: int) -> Workload:
    """ImageNet VGG-16 at 224×224."""
    return classification(VGG16(), batch, (3, 224, 224), 1000)


def build_googlenet(batch: int) -> Workload:
    """ImageNet GoogLeNet at 224×224."""
    return classification(GoogLeNet(), batch, (3, 224, 224), 1000)


def build_resnet3d_18(batch: int, frames: int = 16) -> Workload:
    """r3d_18 on clips of ``frames`` 112×112 RGB frames, 400 Kinetics classes."""
    return classification(R3D18(), batch, (3, frames, 112, 112), 400)


OLLA_BATCH = "OLLA reports batch 1 and 32; default 32"

register(ZooModel(
    "inception-v3", build_inception_v3, batch=96, small_batch=1, paper="Coop",
    description="Inception-v3 (torchvision layout, aux logits off), 3×299×299, 1000 classes; "
                "Coop's batch 96"))
register(ZooModel(
    "unet", build_unet, batch=5, small_batch=1, paper="Coop, DTR",
    description="U-Net, 64–1024 channels, BN, transposed-conv decoder padded to the skip size; "
                "3×460×608 input, 2-class per-pixel cross-entropy; Coop's batch 5 "
                "(DTR: batch 6 at 416×608)"))
register(ZooModel(
    "bilstm", build_bilstm, batch=2048, small_batch=16, paper="Coop",
    description="Bidirectional LSTM (input 100, hidden 256, 128 steps, unrolled per step) and a "
                "2-class linear head on the final states; Coop's batch 2048"))
register(ZooModel(
    "spos-supernet", build_spos_supernet, batch=64, small_batch=2, paper="Coop",
    description="SPOS one-shot NAS supernet: ShuffleNetV2 backbone, 20 layers × 4 candidates "
                "(kernel 3/5/7, Xception), a new path from its seeded random.Random each "
                "forward; 3×224×224, 1000 classes, batch 64 (Coop gives no batch)"))
register(ZooModel(
    "resnet-1202", build_cifar_resnet, batch=64, small_batch=1, paper="DTR",
    description="CIFAR ResNet-1202 (n=200, 16/32/64 channels, zero-pad shortcuts), 3×32×32, "
                "10 classes; batch 64 as in the DTR paper's runs"))
register(ZooModel(
    "densenet-121", build_densenet_121, batch=70, small_batch=2, paper="Coop, DTR",
    description="DenseNet-121 (torchvision layout), 3×224×224, 1000 classes; Coop's batch 70 "
                "(DTR used 84)"))
register(ZooModel(
    "transformer", build_transformer, batch=10, small_batch=1, paper="DTR",
    description="Transformer base on nn.Transformer (512/8 heads/6+6 layers/FFN 2048), "
                "32000-token shared vocabulary tied to the output layer, 128 source and target "
                "tokens; DTR's batch 10"))
register(ZooModel(
    "lstm-lm", build_lstm_lm, batch=256, small_batch=2, paper="DTR",
    description="LSTM language model with DTR's LSTM sizes: embedding 512, one unrolled layer "
                "of hidden 1700, 128 steps, vocabulary 10000; DTR's batch 256"))
register(ZooModel(
    "treelstm", build_treelstm, batch=9, small_batch=2, paper="DTR",
    description="Child-sum TreeLSTM (input 100, memory 300, 5 classes) over a seeded random "
                "binary tree of 48–80 leaves shared by the batch; DTR's batch 9"))
register(ZooModel(
    "alexnet", build_alexnet, batch=32, small_batch=2, paper="OLLA",
    description=f"AlexNet (torchvision layout), 3×224×224, 1000 classes; {OLLA_BATCH}"))
register(ZooModel(
    "vgg-16", build_vgg16, batch=32, small_batch=1, paper="OLLA",
    description=f"VGG-16 without BN, 3×224×224, 1000 classes; {OLLA_BATCH}"))
register(ZooModel(
    "googlenet", build_googlenet, batch=32, small_batch=2, paper="OLLA",
    description="GoogLeNet (torchvision layout, aux classifiers off), 3×224×224, 1000 classes; "
                f"{OLLA_BATCH}"))
register(ZooModel(
    "resnet3d-18", build_resnet3d_18, batch=32, small_batch=1, paper="OLLA",
    description="3-D ResNet-18 (torchvision r3d_18), clips 3×16×112×112, 400 classes; "
                f"{OLLA_BATCH} (OLLA's script feeds 3×1×112×112)"))
