"""Read a table of examples from wherever the user keeps it: a local JSON/JSONL/CSV/Parquet/Arrow file, a folder
written by `Dataset.save_to_disk` or a Hugging Face dataset name (from the local cache; nothing is downloaded
offline); `split@path` picks a split (`test@my_org/my_data`). See docs/data.md.

JSON, JSONL and CSV files are read here, into a list of their rows as written: `datasets` (its import alone
costs a trainer's every rank ~1 s on a small CPU) would also copy each file into its cache as Arrow, which
gives every row the keys of all rows and one type per column. The other sources are `datasets.Dataset`s."""

import csv
import json
from collections.abc import Iterable
from pathlib import Path

FILE_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}


class DataError(ValueError):
    """Bad data: the message names the file, the row and the key."""


class BadRow(DataError):
    """One malformed row. Raised by validators; the caller adds the file and row number."""


def load_table(spec: str, subset: str | None = None):
    """The rows named by `spec`: a list of dicts (JSON, JSONL, CSV) or a `datasets.Dataset`; `subset` picks a
    configuration of a Hugging Face dataset (gsm8k's "main"), which `datasets.load_dataset` then reads from
    `spec` whatever it is. A JSON row whose text is not UTF-8 comes as a `BadRow` naming its key."""
    split, path = spec.split("@", 1) if "@" in spec and not Path(spec).exists() else (None, spec)  # test@data.jsonl
    local = Path(path).expanduser()
    if subset is None and local.is_file():
        fmt = FILE_FORMATS.get(local.suffix.lower())
        if fmt is None:
            raise DataError(f"{local}: unknown file type '{local.suffix}'; use one of {', '.join(FILE_FORMATS)}")
        table = _read_file(local, fmt, split)
    elif subset is None and local.is_dir():
        import datasets

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
        import datasets

        try:
            table = datasets.load_dataset(path, subset, split=split or "train")
        except Exception as e:  # offline hub lookups raise many different types
            how = f"loading its subset '{subset}'" if subset else "it is not a local file or folder, and loading it"
            raise DataError(f"could not load '{path}': {how} as a Hugging Face dataset failed ({type(e).__name__}: "
                            f"{e}). Give a local path, or make the dataset available in the local cache.") from e
    if len(table) == 0:
        raise DataError(f"{spec}: no rows")
    return table


def take(rows, indices: Iterable[int]):
    """The rows at `indices`, in that order, of a list or a `datasets.Dataset`."""
    return [rows[i] for i in indices] if isinstance(rows, list) else rows.select(indices)


# What to check in a file of each format that could not be read.
FORMAT_HINTS = {
    "json": "a .jsonl file needs one complete JSON object per line, a .json file one JSON array of objects "
            "(or one object per line)",
    "csv": "the first line names the columns and every line has that many comma-separated fields "
           "(quote a field that holds a comma or a line break)",
    "parquet": "the file may be truncated or not a Parquet file; write it again",
    "arrow": "the file may be truncated or not an Arrow file; write it again",
}


def _read_file(path: Path, fmt: str, split: str | None):
    """The rows of one local file; whatever goes wrong reading it is a DataError naming the file."""
    if split is not None and split.split("[", 1)[0] != "train":  # "train[:100]" slices are fine
        raise DataError(f"{split}@{path}: a single file has only the split 'train'; drop '{split}@' from the "
                        f"path, or give a folder or dataset that has a '{split}' split")
    if path.stat().st_size == 0:
        raise DataError(f"{path}: the file is empty; give a file with rows")
    try:
        if fmt not in ("json", "csv"):
            import datasets

            return datasets.load_dataset(fmt, data_files=str(path), split=split or "train")
        rows = _json_rows(path) if fmt == "json" else _csv_rows(path)
    except DataError:
        raise
    except Exception as e:  # the readers raise many types: DatasetGenerationError, ArrowInvalid, csv.Error...
        # DatasetGenerationError only says "An error occurred"; what went wrong is its cause.
        cause = e.__cause__ if type(e).__name__ == "DatasetGenerationError" and e.__cause__ else e
        reason = f"{type(cause).__name__}: {str(cause).strip()}"
        raise DataError(f"{path}: could not read it as {fmt.upper()} ({reason}); fix the file: "
                        f"{FORMAT_HINTS[fmt]}") from e
    if split in (None, "train"):
        return rows
    import datasets  # its parser of split slices: "train[:100]", "train[-10%:]", "train[:5]+train[9:]"

    return [row for part in datasets.ReadInstruction.from_spec(split).to_absolute({"train": len(rows)})
            for row in rows[part.from_ : part.to]]


def _json_rows(path: Path) -> list:
    """A .json file's array of objects (or its one object), else one object a line (JSON Lines, a .jsonl file's
    form). Text is read as UTF-8; a row with a string that is not (Latin-1 text, say) is a `BadRow`."""
    text = path.read_bytes().decode("utf-8-sig", errors="surrogateescape")
    if path.suffix.lower() == ".json":
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:
            whole = None  # not one JSON value: JSON Lines
        if isinstance(whole, list):
            return [_json_row(row, f"item {number} of the array") for number, row in enumerate(whole)]
        if isinstance(whole, dict):
            return [_json_row(whole, "the file")]
    rows = []
    for number, line in enumerate(text.split("\n"), 1):  # not splitlines: a JSON string may hold U+2028 as it is
        if line.strip():
            try:
                rows.append(_json_row(json.loads(line), f"line {number}"))
            except json.JSONDecodeError as e:
                raise ValueError(f"line {number}: {e}") from None
    return rows


def _json_row(value, where: str):
    """A JSON value that must be a row: a dict, or its BadRow when a string in it was not UTF-8."""
    if not isinstance(value, dict):
        raise ValueError(f"{where} is {type(value).__name__}, not an object")
    return _undecodable(value) or value


def _csv_rows(path: Path) -> list:
    """Every column as text, as written: a response of digits stays a string, "NA" or "None" too; an empty cell
    is missing (None). Every line must have the header's number of fields."""
    with open(path, newline="", encoding="utf-8-sig", errors="surrogateescape") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if not header:
            raise DataError(f"{path}: no header row; a CSV file needs column names in its first line")
        rows = []
        for fields in reader:
            if not fields:  # a blank line
                continue
            if len(fields) != len(header):
                raise ValueError(f"line {reader.line_num} has {len(fields)} fields, the header {len(header)}")
            row = {name: value if value != "" else None for name, value in zip(header, fields)}
            rows.append(_undecodable(row) or row)
        return rows


def _undecodable(row: dict):
    """A `BadRow` naming the first key whose text (in it, at any depth) was not UTF-8; None when all was."""
    for key, value in row.items():
        for text in _strings(value):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:  # a byte that was no UTF-8, kept as a lone surrogate, or a "\\ud800"
                try:
                    text.encode("utf-8", errors="surrogateescape").decode("utf-8")
                except UnicodeEncodeError:
                    return BadRow(f"key '{key}' holds a lone surrogate escape, which is no text")
                except UnicodeDecodeError as e:
                    return BadRow(f"key '{key}' is not valid UTF-8 (byte {e.object[e.start:e.start + 1]!r} at offset "
                                  f"{e.start}: {e.reason}); write the file as UTF-8")
    return None


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict | list):
        for item in value.values() if isinstance(value, dict) else value:
            yield from _strings(item)
