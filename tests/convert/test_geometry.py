"""Masks and boxes follow the image exactly as torchvision.transforms.v2 moves ``tv_tensors.Mask`` and
``tv_tensors.BoundingBoxes``: every resize policy, EXIF orientations 1-8, on a real photograph.

The photograph is matplotlib's ``grace_hopper.jpg`` (public domain); its masks are its own grey levels
quantised to ids (real, ragged edges), and its boxes are those masks' boxes (``masks_to_boxes``), so
masks and boxes describe the same objects. References are v2 itself, run on the same inputs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import tv_tensors
from torchvision.ops import masks_to_boxes
from torchvision.transforms import v2

from dlstore.spec import ImagePolicy
from dlstore.write.geometry import Geometry, place_boxes, place_mask
from dlstore.write.imageops import _TRANSPOSE, target_size


@pytest.fixture(scope="module")
def photo_mask() -> np.ndarray:
    cbook = pytest.importorskip("matplotlib.cbook")
    with Image.open(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)) as img:
        grey = np.asarray(img.convert("L"))
    return (grey // 52).astype(np.uint8)  # ids 0..4: the photo's light and dark regions


def boxes_of(mask: np.ndarray) -> np.ndarray:
    """XYXY pixel-edge boxes of each id's pixels (masks_to_boxes gives the last pixel, so + 1)."""
    ids = np.unique(mask)
    stack = torch.from_numpy(np.stack([mask == i for i in ids]))
    return (masks_to_boxes(stack) + torch.tensor([0, 0, 1, 1])).numpy()


# (left, top, width, height) cuts of the photo (512 x 600): portrait, landscape, tiny, odd sizes
CUTS = [(0, 0, 512, 600), (0, 100, 512, 301), (40, 37, 97, 45), (11, 200, 333, 399), (300, 0, 7, 600)]


def v2_reference(mask: np.ndarray, boxes: np.ndarray, policy: ImagePolicy) -> tuple[np.ndarray, np.ndarray]:
    h, w = mask.shape
    m = tv_tensors.Mask(torch.from_numpy(mask.copy()))
    b = tv_tensors.BoundingBoxes(torch.from_numpy(boxes), format="XYXY", canvas_size=(h, w))
    n = policy.size
    if policy.resize == "crop":
        t = v2.Compose([v2.Resize(n), v2.CenterCrop(n)])
    elif policy.resize == "stretch":
        t = v2.Resize((n, n))
    elif policy.resize == "shorter":
        t = v2.Resize(n, max_size=policy.max_side)
    else:  # pad: the resize, then the padding v2.CenterCrop gives the image (see test docstring)
        tw, th = target_size((w, h), policy)
        left, top = (n - tw) // 2, (n - th) // 2
        t = v2.Compose([v2.Resize((th, tw)), v2.Pad([left, top, n - tw - left, n - th - top])])
    m2, b2 = t(m, b)
    return m2.numpy(), b2.numpy()


@pytest.mark.parametrize("resize", ["crop", "pad", "stretch", "shorter"])
def test_masks_and_boxes_follow_every_policy_as_v2(photo_mask: np.ndarray, resize: str) -> None:
    """Masks equal v2's exactly; boxes within 0.5 px (they are floats: equal up to rounding); a box v2
    leaves with no area is the one dropped. For ``pad`` the reference pads like v2.CenterCrop pads the
    image: v2's own box kernel anchors an odd padding 1 px off its image (round half to even)."""
    for size, max_side in [(37, None), (64, None), (224, 300)]:
        policy = ImagePolicy(size=size, resize=resize, max_side=max_side if resize == "shorter" else None)
        for left, top, w, h in CUTS:
            mask = np.ascontiguousarray(photo_mask[top : top + h, left : left + w])
            boxes = boxes_of(mask)
            geometry = Geometry((w, h))
            target = target_size((w, h), policy)
            got_mask = place_mask(mask, geometry, target, policy)
            got_boxes, keep = place_boxes(boxes, geometry, target, policy)
            ref_mask, ref_boxes = v2_reference(mask, boxes, policy)
            np.testing.assert_array_equal(got_mask, ref_mask, err_msg=f"{resize} {size} {w}x{h}")
            alive = np.flatnonzero((ref_boxes[:, 2] > ref_boxes[:, 0]) & (ref_boxes[:, 3] > ref_boxes[:, 1]))
            np.testing.assert_array_equal(keep, alive)
            np.testing.assert_allclose(got_boxes, ref_boxes[alive], atol=0.5, err_msg=f"{resize} {size}")


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_turns_masks_and_boxes_with_the_image(
    photo_mask: np.ndarray, orientation: int
) -> None:
    """Annotations in the file's stored frame: the mask turned as PIL turns the image, and the boxes
    are the turned mask's own boxes, then v2's Resize + CenterCrop."""
    stored = np.ascontiguousarray(photo_mask[50:450, 20:320])  # 300 x 400, not square
    method = _TRANSPOSE.get(orientation)
    turned = stored if method is None else np.asarray(Image.fromarray(stored).transpose(method))
    policy = ImagePolicy(size=96)
    geometry = Geometry((300, 400), orientation)
    assert geometry.oriented_size == turned.shape[::-1]
    target = target_size(geometry.oriented_size, policy)
    ref_mask, ref_boxes = v2_reference(turned, boxes_of(turned), policy)
    np.testing.assert_array_equal(place_mask(stored, geometry, target, policy), ref_mask)
    got, keep = place_boxes(boxes_of(stored), geometry, target, policy)
    np.testing.assert_allclose(got, ref_boxes[keep], atol=0.5)
    assert len(keep) == len(ref_boxes)


def test_clipped_boxes_are_dropped_and_counted() -> None:
    policy = ImagePolicy(size=10)  # 20 x 10 → 20 x 10 resized... a 10 px centre crop keeps x 5..15
    boxes = np.array([[0, 0, 4, 4], [0, 0, 6, 5], [16, 2, 20, 8], [4, 1, 16, 9]], np.float64)
    got, keep = place_boxes(boxes, Geometry((20, 10)), target_size((20, 10), policy), policy)
    np.testing.assert_array_equal(keep, [1, 3])
    np.testing.assert_allclose(got, [[0, 0, 1, 5], [0, 1, 10, 9]])
