"""Lab 06's plausible mistakes, one per code exercise (graded as the submission wrong_code: tests/labtests.py)."""
WRONG = [
    # exercise 2: the checkpoint and the manifest written in place, under their final names (no temporary file, no
    # fsync, no rename): the kill in the middle of the save leaves a half-written step-00000012.pt
    ("    atomic_write(directory / name, data)",
     """directory = Path(directory)
name = f"step-{step:08d}.pt"
torch.save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "rng": torch.get_rng_state()}, directory / name)
data = (directory / name).read_bytes()
manifest = directory / MANIFEST
entries = json.loads(manifest.read_text())["checkpoints"] if manifest.exists() else []
entries.append({"step": step, "file": name, "checksum": f"crc32:{zlib.crc32(data):08x}", "bytes": len(data)})
manifest.write_text(json.dumps({"checkpoints": entries}))"""),
    # exercise 3: the newest file in the folder, found by listing it (no manifest, no checksum)
    ("    for entry in reversed(entries):",
     """files = sorted(Path(directory).glob("step-*.pt"))
if not files:
    return 0
state = torch.load(files[-1], weights_only=True)
model.load_state_dict(state["model"])
optimizer.load_state_dict(state["optimizer"])
torch.set_rng_state(state["rng"])
return int(state["step"])"""),
]
