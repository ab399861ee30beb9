"""LLaVA-format records (data/llava.py): the placeholder rule, multi-image and text-only
samples, and one clear line for each kind of bad record, image or file."""

import json

import numpy as np
import pytest
from PIL import Image

from megatron_mllm.data.llava import IMAGE, parse_record, read_records
from megatron_mllm.errors import ConfigError


def turns(*values, roles=("human", "gpt")):
    return [{"from": r, "value": v} for r, v in zip(roles, values, strict=True)]


def test_fewer_placeholders_go_before_the_first_human_turn():
    raw = {"id": "a", "image": ["x.png", "y.jpg"], "conversations": turns("Which is larger?", "7")}
    rec = parse_record(raw, 0)
    assert rec.images == ("x.png", "y.jpg")
    assert rec.turns[0] == ("human", f"{IMAGE}\n{IMAGE}\nWhich is larger?")
    system_first = [{"from": "system", "value": "Be brief."}, *turns("What digit?", "3")]
    rec = parse_record({"id": "b", "image": "x.png", "conversations": system_first}, 1)
    assert rec.turns[0] == ("system", "Be brief.") and rec.turns[1][1].startswith(IMAGE)


def test_equal_placeholders_stay_where_the_text_puts_them():
    raw = {"id": "c", "image": ["x.png", "y.png"],
           "conversations": turns(f"Left {IMAGE} right {IMAGE}: which?", "left")}  # fmt: skip
    assert parse_record(raw, 0).turns[0][1] == f"Left {IMAGE} right {IMAGE}: which?"


def test_text_only_records_have_no_images():
    rec = parse_record({"conversations": turns("2 + 3?", "5")}, 4)
    assert rec.id == "#4" and rec.images == () and IMAGE not in rec.turns[0][1]


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"id": "m", "image": "x.png", "conversations": turns(f"{IMAGE}{IMAGE}", "?")},
         "record m: 2 <image> placeholders but 1 image(s)"),
        ({"id": "n"}, "record n: no 'conversations'"),
        ({"id": "r", "conversations": [{"from": "bot", "value": "hi"}]},
         "record r: a turn from 'bot'"),
        ({"id": "i", "image": 3, "conversations": turns("a", "b")},
         "record i: 'image' must be a file name"),
        ({"id": "h", "image": "x.png", "conversations": turns("a", roles=("gpt",))},
         "record h: images without a human turn"),
    ],
)  # fmt: skip
def test_bad_records_fail_in_one_line(raw, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_record(raw, 0)


def test_files_and_images_are_checked_and_named(tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    Image.fromarray(np.zeros((37, 53, 3), np.uint8)).save(folder / "ok.png")
    Image.fromarray(np.full((8, 300, 3), 255, np.uint8)).save(folder / "wide.jpg")
    (folder / "broken.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    records = [{"id": "1", "image": ["ok.png", "wide.jpg"], "conversations": turns("?", "1")},
               {"id": "2", "conversations": turns("1 + 1?", "2")}]  # fmt: skip
    good = tmp_path / "data.json"
    good.write_text(json.dumps(records))
    assert [r.id for r in read_records(good, folder)] == ["1", "2"]
    lines = tmp_path / "data.jsonl"
    lines.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    assert len(read_records(lines)) == 2
    for image, why in (("gone.png", "does not exist"), ("broken.jpg", "does not decode")):
        bad = tmp_path / f"bad_{why[:4]}.json"
        bad.write_text(json.dumps([{"id": "z", "image": image, "conversations": turns("?", "!")}]))
        with pytest.raises(ConfigError, match=f"record z: image '{image}' {why}"):
            read_records(bad, folder)
    for content, why in (("{}", "expected a list of records"), ("[1, 2]", "expected a list"),
                         ("[{", "not JSON")):  # fmt: skip
        path = tmp_path / "x.json"
        path.write_text(content)
        with pytest.raises(ConfigError, match=why):
            read_records(path)
    (tmp_path / "bin.json").write_bytes(b"\x89PNG\xff\xfe")
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        read_records(tmp_path / "bin.json")
    with pytest.raises(ConfigError, match="is a directory"):
        read_records(folder)


def test_the_tiny_llava_digits_set(tmp_path):
    """tools/make_llava_digits.py's data: every source, zero to two images a record, PNG and
    JPEG of several sizes, answers that match the pictures, and no overwriting."""
    from megatron_mllm.data.llava_digits import SOURCES, write_llava_digits

    path = write_llava_digits(tmp_path / "d", n=40, seed=1)
    raw = json.loads(path.read_text())
    records = read_records(path, tmp_path / "d" / "images")
    assert {r["source"] for r in raw} == set(SOURCES)
    assert {len(r.images) for r in records} == {0, 1, 2}
    files = list((tmp_path / "d" / "images").iterdir())
    assert {f.suffix for f in files} == {".png", ".jpg"}
    assert len({Image.open(f).size for f in files}) > 3
    for r, rec in zip(raw, records, strict=True):
        answer = rec.turns[1][1]
        if r["source"] == "count":
            (strip,) = rec.images
            width, height = Image.open(tmp_path / "d" / "images" / strip).size
            assert 1 <= int(answer) <= 4 and width >= int(answer) * 16
        if r["source"] == "compare":
            assert answer in ("first", "second")
    with pytest.raises(ConfigError, match="is not an empty folder"):
        write_llava_digits(tmp_path / "d", n=4)


def test_llava_digits_drawn_from_a_distribution_of_images(tmp_path):
    """`--images-per-sample DIST`: each record's image count is drawn from DIST (0 text-only,
    1 digit, 2 compare, more: which of them shows the largest digit), every image has its
    placeholder and its file, and the answer is one of the images."""
    from megatron_mllm.data.llava_digits import write_llava_digits

    dist = {0: 0.2, 1: 0.3, 4: 0.3, 8: 0.2}
    path = write_llava_digits(tmp_path / "d", n=80, seed=2, images=dist)
    raw = json.loads(path.read_text())
    records = read_records(path, tmp_path / "d" / "images")
    counts = [len(r.images) for r in records]
    assert set(counts) == set(dist)
    assert abs(sum(counts) / len(counts) - 3.1) < 0.8  # the distribution's mean, 80 draws
    source = {0: "math", 1: "digit", 4: "largest", 8: "largest"}
    assert [r["source"] for r in raw] == [source[c] for c in counts]
    for r, rec in zip(raw, records, strict=True):
        if r["source"] == "largest":
            assert rec.turns[0][1].count(IMAGE) == len(rec.images)
            assert 1 <= int(rec.turns[1][1]) <= len(rec.images)
            assert all((tmp_path / "d" / "images" / f).is_file() for f in rec.images)


def test_image_paths_stay_inside_the_image_folder(tmp_path):
    """Absolute names, '..' and links that lead outside --image-folder are refused with one
    line that does not say whether the file exists; a link inside the folder is followed; an
    image over the pixel bound is refused naming record and file."""
    from megatron_mllm.data.llava import check_images, parse_record

    folder, outside = tmp_path / "images", tmp_path / "secret"
    folder.mkdir()
    outside.mkdir()
    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(folder / "ok.png")
    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(outside / "there.png")
    (folder / "inside.png").symlink_to(folder / "ok.png")
    (folder / "out.png").symlink_to(outside / "there.png")
    (folder / "out_missing.png").symlink_to(outside / "nothing.png")

    def record(name):
        return parse_record({"id": "r", "image": name, "conversations": turns("?", "!")}, 0)

    check_images(record("inside.png"), folder)
    lines = {}
    for name in ("../secret/there.png", "../secret/nothing.png", str(outside / "there.png"),
                 str(outside / "nothing.png"), "out.png", "out_missing.png"):  # fmt: skip
        with pytest.raises(ConfigError) as err:
            check_images(record(name), folder)
        msg = str(err.value)
        assert "\n" not in msg and "exist" not in msg and "decode" not in msg, msg
        lines[name] = msg.replace(name, "NAME")
    # an existing and a missing file outside get the same line
    assert lines["../secret/there.png"] == lines["../secret/nothing.png"]
    assert lines[str(outside / "there.png")] == lines[str(outside / "nothing.png")]
    assert lines["out.png"] == lines["out_missing.png"]
    with pytest.raises(ConfigError, match=r"record r: image 'ok.png' has 16x16 pixels, over"):
        check_images(record("ok.png"), folder, max_pixels=100)


def test_llava_digits_images_drawn_from_a_distribution_of_sizes(tmp_path):
    """`--image-sizes DIST`: every digit's side is one of DIST's, each drawn (a
    native-resolution tower then sees from 16 to 1600 patches of 4 pixels a digit)."""
    from PIL import Image

    from megatron_mllm.data.llava_digits import write_llava_digits

    sizes = {16: 0.4, 64: 0.3, 160: 0.3}
    path = write_llava_digits(tmp_path / "d", n=40, seed=3, sizes=sizes)
    records = read_records(path, tmp_path / "d" / "images")
    seen = []
    for record in records:
        for name in record.images:
            with Image.open(tmp_path / "d" / "images" / name) as img:
                seen.append(img.size)
    # Square digits of the drawn sides; the count task's strips are several side by side.
    assert {h for w, h in seen} == set(sizes)
    assert all(w == h or w >= 2 * min(sizes) for w, h in seen)
