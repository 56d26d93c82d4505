"""`make images REGISTRY=... TAG=...` (scripts/build_images.sh) against a stand-in docker: it builds the CPU and
the CUDA image with the right torch variant and tags, pushes both, and prints an `images:` block that, put in a
site overlay, makes every dfca container pull from that registry."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import yaml
from deploy_manifest import REPO, SITE_EXAMPLE_DIR, image_repository, is_dfca_image, render_overlay, workloads

FAKE_DOCKER = """#!/usr/bin/env bash
echo "$*" >> "$DOCKER_LOG"
"""


def run_make(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "docker").write_text(FAKE_DOCKER)
    (bin_dir / "docker").chmod(0o755)
    log = tmp_path / "docker.log"
    log.unlink(missing_ok=True)
    command = ["make", "-s", "images", *args] if shutil.which("make") else \
        ["bash", "scripts/build_images.sh", *(a.split("=", 1)[1] for a in args)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "DOCKER_LOG": str(log), **env})
    return done, log.read_text().splitlines() if log.exists() else []


def test_make_images_builds_pushes_and_prints_the_overlay_images(tmp_path: Path) -> None:
    registry = "europe-west4-docker.pkg.dev/proj/dfca"
    done, calls = run_make(tmp_path, f"REGISTRY={registry}", "TAG=1.2.3", TORCH_CUDA_VARIANT="cu126")
    assert done.returncode == 0, done.stderr
    assert calls == [
        f"build --platform linux/amd64 --build-arg TORCH_VARIANT=cpu -t {registry}/dfca:1.2.3 .",
        f"build --platform linux/amd64 --build-arg TORCH_VARIANT=cu126 -t {registry}/dfca-cuda:1.2.3 .",
        f"push {registry}/dfca:1.2.3",
        f"push {registry}/dfca-cuda:1.2.3",
    ]
    block = yaml.safe_load(done.stdout)["images"]
    site = tmp_path / "k8s-config" / "mine"
    shutil.copytree(SITE_EXAMPLE_DIR, site)
    for folder in ("k8s", "k8s-config/components"):  # the site's relative paths, as in a checkout
        shutil.copytree(REPO / folder, tmp_path / folder)
    kustomization = yaml.safe_load((site / "kustomization.yaml").read_text())
    kustomization["images"] = block
    (site / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    images = {c["image"] for w in workloads(render_overlay(site))
              for c in w["spec"]["template"]["spec"]["containers"] if is_dfca_image(c["image"])}
    assert images == {f"{registry}/dfca:1.2.3", f"{registry}/dfca-cuda:1.2.3"}
    assert {image_repository(i) for i in images} == {"dfca", "dfca-cuda"}


def test_make_images_needs_a_registry_and_local_builds_without_pushing(tmp_path: Path) -> None:
    done, calls = run_make(tmp_path)
    assert done.returncode != 0 and "REGISTRY=" in done.stderr and calls == []
    done, calls = run_make(tmp_path, "REGISTRY=local")
    assert done.returncode == 0, done.stderr
    assert [c.split()[0] for c in calls] == ["build", "build"] and calls[0].endswith("-t dfca:0.1.0 .")
