"""Read a table of examples from wherever the user keeps it: a local JSON/JSONL/CSV/Parquet/Arrow file, a folder
written by `Dataset.save_to_disk` or a Hugging Face dataset name (from the local cache; nothing is downloaded
offline); `split@path` picks a split (`test@my_org/my_data`). See docs/data.md."""

import csv
from pathlib import Path

import datasets

FILE_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}


class DataError(ValueError):
    """Bad data: the message names the file, the row and the key."""


def load_table(spec: str, subset: str | None = None) -> datasets.Dataset:
    """Load the examples named by `spec` as a `datasets.Dataset`; `subset` picks a configuration of a Hugging Face
    dataset (gsm8k's "main"), which `datasets.load_dataset` then reads from `spec` whatever it is."""
    split, path = spec.split("@", 1) if "@" in spec and not Path(spec).exists() else (None, spec)  # test@data.jsonl
    local = Path(path).expanduser()
    if subset is None and local.is_file():
        fmt = FILE_FORMATS.get(local.suffix.lower())
        if fmt is None:
            raise DataError(f"{local}: unknown file type '{local.suffix}'; use one of {', '.join(FILE_FORMATS)}")
        table = _read_file(local, fmt, split)
    elif subset is None and local.is_dir():
        try:
            table = datasets.load_from_disk(str(local))
        except FileNotFoundError:  # a folder of data files (no dataset_info.json / state.json)
            files = sorted(p.name for p in local.iterdir() if p.suffix.lower() in FILE_FORMATS)
            listed = f" ({', '.join(files[:6])}{', ...' if len(files) > 6 else ''})" if files else ""
            raise DataError(f"{local}: a folder that datasets' save_to_disk did not write; give a file in it{listed} "
                            f"or a save_to_disk folder") from None
        if isinstance(table, datasets.DatasetDict):
            split = split or ("train" if "train" in table else next(iter(table)))
            if split not in table:
                raise DataError(f"{local}: no split '{split}'; it has {', '.join(table)}")
            table = table[split]
    else:
        try:
            table = datasets.load_dataset(path, subset, split=split or "train")
        except Exception as e:  # offline hub lookups raise many different types
            how = f"loading its subset '{subset}'" if subset else "it is not a local file or folder, and loading it"
            raise DataError(f"could not load '{path}': {how} as a Hugging Face dataset failed ({type(e).__name__}: "
                            f"{e}). Give a local path, or make the dataset available in the local cache.") from e
    if len(table) == 0:
        raise DataError(f"{spec}: no rows")
    return table


# What to check in a file of each format that could not be read.
FORMAT_HINTS = {
    "json": "a .jsonl file needs one complete JSON object per line, a .json file one JSON array of objects "
            "(or one object per line)",
    "csv": "the first line names the columns and every line has that many comma-separated fields "
           "(quote a field that holds a comma or a line break)",
    "parquet": "the file may be truncated or not a Parquet file; write it again",
    "arrow": "the file may be truncated or not an Arrow file; write it again",
}


def _read_file(path: Path, fmt: str, split: str | None) -> datasets.Dataset:
    """The rows of one local file; whatever goes wrong reading it is a DataError naming the file."""
    if split is not None and split.split("[", 1)[0] != "train":  # "train[:100]" slices are fine
        raise DataError(f"{split}@{path}: a single file has only the split 'train'; drop '{split}@' from the "
                        f"path, or give a folder or dataset that has a '{split}' split")
    if path.stat().st_size == 0:
        raise DataError(f"{path}: the file is empty; give a file with rows")
    try:
        options = _csv_as_text(path) if fmt == "csv" else {}
        return datasets.load_dataset(fmt, data_files=str(path), split=split or "train", **options)
    except DataError:
        raise
    except Exception as e:  # the readers raise many types: DatasetGenerationError, ArrowInvalid, UnicodeDecodeError...
        # DatasetGenerationError only says "An error occurred"; what went wrong is its cause.
        cause = e.__cause__ if isinstance(e, datasets.exceptions.DatasetGenerationError) and e.__cause__ else e
        reason = f"{type(cause).__name__}: {str(cause).strip()}"
        raise DataError(f"{path}: could not read it as {fmt.upper()} ({reason}); fix the file: "
                        f"{FORMAT_HINTS[fmt]}") from e


def _csv_as_text(path: Path) -> dict:
    """`load_dataset` options that read every column of a CSV file as a string: else pandas guesses a type per
    column (and per 10k-row chunk), a response of digits becomes a float and "NA", "null" or "None" missing."""
    with open(path, newline="", encoding="utf-8-sig") as f:
        header = next(csv.reader(f), None)
    if not header:
        raise DataError(f"{path}: no header row; a CSV file needs column names in its first line")
    features = datasets.Features({name: datasets.Value("string") for name in header})
    return {"features": features, "keep_default_na": False, "na_values": [""]}
