"""The three ways a folder federation holds a client's samples, each read into numpy arrays (x, y).

- arrays: `DIR/<client-id>/train.npz` with `x` [n, ...] (float or uint8) and `y` [n] (integers), and optionally
  `DIR/<client-id>/test.npz` (numpy);
- images: `DIR/<client-id>/train/<label>/*.png|jpg|jpeg` and optionally `test/<label>/...`; `<label>` is the class
  index 0..C-1; greyscale images give 1 channel, all others are read as RGB (Pillow);
- a table: one CSV or Parquet file with a `client` column, a `label` column, an optional `split` column (`train` or
  `test`) and one numeric column per feature (pandas; Parquet needs pyarrow).

Nothing here checks values (dfca.data.folder_checks does): a reader only finds the files and reports the ones it
cannot read as problems naming the file and the client.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dfca.data.folder_checks import Problem

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
TABLE_SUFFIXES = (".csv", ".parquet", ".pq")
CLIENT_COLUMN, LABEL_COLUMN, SPLIT_COLUMN = "client", "label", "split"
GREYSCALE_MODES = ("1", "L", "LA", "I", "I;16", "F")


@dataclass
class Part:
    """A client's train or test samples as stored: x [n, ...] (uint8 or float), y [n]; `file` they came from."""

    x: np.ndarray
    y: np.ndarray
    file: Path


@dataclass
class ClientFiles:
    """What a client holds: its train samples, and its test samples where it has its own (else None)."""

    name: str
    train: Part
    test: Part | None


def is_table(path: Path) -> bool:
    return path.suffix.lower() in TABLE_SUFFIXES


def read_client_folder(folder: Path, client: str) -> tuple[ClientFiles | None, list[Problem]]:
    """A client folder's samples: arrays (train.npz) or images (train/<label>/)."""
    if not folder.is_dir():
        return None, [Problem(folder, client, "no such client folder")]
    npz, images = folder / "train.npz", folder / "train"
    if npz.is_file() and images.is_dir():
        return None, [Problem(folder, client, "holds both train.npz and a train/ image folder; keep one")]
    if npz.is_file():
        read = read_npz
    elif images.is_dir():
        read = read_images
    else:
        return None, [Problem(folder, client, "holds neither train.npz nor a train/<label>/ image folder")]
    train, problems = read(npz if read is read_npz else images, client)
    test_path = folder / ("test.npz" if read is read_npz else "test")
    test: Part | None = None
    if test_path.exists():
        test, more = read(test_path, client)
        problems += more
    if train is None or problems:
        return None, problems
    return ClientFiles(client, train, test), []


def read_npz(file: Path, client: str) -> tuple[Part | None, list[Problem]]:
    try:
        with np.load(file, allow_pickle=False) as arrays:
            missing = [k for k in ("x", "y") if k not in arrays.files]
            if missing:
                return None, [Problem(file, client, f"has no array {' or '.join(missing)} (it holds "
                                      f"{', '.join(arrays.files) or 'nothing'}); expected x and y")]
            return Part(arrays["x"], arrays["y"], file), []
    except (OSError, ValueError, EOFError) as err:
        return None, [Problem(file, client, f"is not a readable .npz file ({err})")]


def read_images(folder: Path, client: str) -> tuple[Part | None, list[Problem]]:
    from PIL import Image, UnidentifiedImageError

    problems: list[Problem] = []
    pixels: list[np.ndarray] = []
    labels: list[int] = []
    for label_dir in sorted(p for p in folder.iterdir() if p.is_dir()):
        if not label_dir.name.isdigit():
            problems.append(Problem(label_dir, client, f"label folder {label_dir.name!r} is not an integer class "
                                    "index 0..C-1"))
            continue
        for file in sorted(p for p in label_dir.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES):
            try:
                with Image.open(file) as image:
                    mode = "L" if image.mode in GREYSCALE_MODES else "RGB"
                    array = np.asarray(image.convert(mode), dtype=np.uint8)
            except (OSError, UnidentifiedImageError) as err:
                problems.append(Problem(file, client, f"is not a readable image ({err})"))
                continue
            array = array[None] if array.ndim == 2 else array.transpose(2, 0, 1)
            if pixels and array.shape != pixels[0].shape:
                problems.append(Problem(file, client, f"image of shape {array.shape}, but {folder} begins with "
                                        f"{pixels[0].shape}; every image must have one size and colour mode"))
                continue
            pixels.append(array)
            labels.append(int(label_dir.name))
    if problems:
        return None, problems
    x = np.stack(pixels) if pixels else np.zeros((0, 1, 1, 1), dtype=np.uint8)
    return Part(x, np.asarray(labels, dtype=np.int64), folder), []


def read_table(file: Path, columns: list[str] | None = None) -> object:
    """The table as a pandas DataFrame (only `columns`, where given)."""
    import pandas as pd

    if file.suffix.lower() == ".csv":
        return pd.read_csv(file, usecols=columns, dtype={CLIENT_COLUMN: str})
    try:
        frame = pd.read_parquet(file, columns=columns)
    except ImportError as err:
        raise ImportError(f"{file}: reading Parquet needs pyarrow (pip install 'dfca[tables]')") from err
    frame[CLIENT_COLUMN] = frame[CLIENT_COLUMN].astype(str)
    return frame


def table_client_ids(file: Path) -> list[str]:
    """The distinct values of a table's client column, sorted."""
    frame = read_table(file, [CLIENT_COLUMN])
    return sorted(set(frame[CLIENT_COLUMN]))  # type: ignore[index]


def read_table_clients(file: Path, clients: list[str]) -> tuple[dict[str, ClientFiles], list[Problem]]:
    """The rows of `clients` from a table: features are every column but client, label and split."""
    import pandas as pd

    frame = read_table(file)
    assert isinstance(frame, pd.DataFrame)
    missing = [c for c in (CLIENT_COLUMN, LABEL_COLUMN) if c not in frame.columns]
    if missing:
        return {}, [Problem(file, None, f"has no column {' or '.join(map(repr, missing))} (columns: "
                            f"{', '.join(map(str, frame.columns))})")]
    features = [c for c in frame.columns if c not in (CLIENT_COLUMN, LABEL_COLUMN, SPLIT_COLUMN)]
    text = [c for c in features if not pd.api.types.is_numeric_dtype(frame[c]) or pd.api.types.is_bool_dtype(frame[c])]
    if not features or text:
        what = f"the feature columns {', '.join(map(repr, text))} are not numeric" if text else "has no feature column"
        return {}, [Problem(file, None, what)]
    if SPLIT_COLUMN in frame.columns and (bad := set(frame[SPLIT_COLUMN].astype(str)) - {"train", "test"}):
        return {}, [Problem(file, None, f"column 'split' holds {sorted(bad)[0]!r}; only train or test")]
    found: dict[str, ClientFiles] = {}
    for client, rows in frame[frame[CLIENT_COLUMN].isin(clients)].groupby(CLIENT_COLUMN, sort=True):
        x = rows[features].to_numpy(dtype=np.float32)
        y = rows[LABEL_COLUMN].to_numpy()
        if SPLIT_COLUMN not in rows.columns:
            found[str(client)] = ClientFiles(str(client), Part(x, y, file), None)
            continue
        is_test = (rows[SPLIT_COLUMN].astype(str) == "test").to_numpy()
        test = Part(x[is_test], y[is_test], file) if is_test.any() else None
        found[str(client)] = ClientFiles(str(client), Part(x[~is_test], y[~is_test], file), test)
    return found, []
