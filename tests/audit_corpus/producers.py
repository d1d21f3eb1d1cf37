"""Tensors from known producers: safe_open(...).get_tensor, the engines' *_weights_iterator,
fastsafetensors, runai-model-streamer and InstantTensor handles."""
import torch
from safetensors import safe_open


def keep_from_safe_open(files: list[str]) -> dict:
    state_dict = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                state_dict[name] = f.get_tensor(name)  # expect: OWN101
    return state_dict


def keep_from_iterator(files: list[str]):
    kept = []
    for name, tensor in safetensors_weights_iterator(files, True):
        kept.append((name, tensor))  # expect: OWN101
    return kept


def keep_from_fastsafetensors(loader_cls, files: list[str], names: list[str]):
    loader = SafeTensorsFileLoader(files, device="cpu")
    buffers = loader.copy_files_to_device()
    kept = {}
    for name in names:
        kept[name] = buffers.get_tensor(name)  # expect: OWN101
    buffers.close()
    return kept


def keep_from_runai(files: list[str]):
    last = {}
    with SafetensorsStreamer() as streamer:
        streamer.stream_files(files, device="cpu")
        for name, tensor in streamer.get_tensors():
            last[name.split(".")[0]] = tensor  # expect: OWN101
    return last


def keep_from_instanttensor(instanttensor, files: list[str]):
    out = []
    with instanttensor.safe_open(files, framework="pt", device=0) as f:
        for name, tensor in f.tensors():
            out.append(tensor)  # expect: OWN101
    return out


# -- safe look-alikes ---------------------------------------------------------------------------------
def safe_from_safe_open(files: list[str]):
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                param = f.get_tensor(name)
                yield name, param  # handed on, one per step


def safe_cloned_from_runai(files: list[str]):
    owned = {}
    with SafetensorsStreamer() as streamer:
        streamer.stream_files(files, device="cpu")
        for name, tensor in streamer.get_tensors():
            owned[name] = tensor.clone()
    return owned


def safe_names_from_safe_open(path: str):
    with safe_open(path, framework="pt") as f:
        names = list(f.keys())
        meta = f.metadata()
    return names, meta
