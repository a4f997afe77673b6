"""Rewrites a torch.save file (a zip archive) into a hostile variant, for test_hostile_files.

    hostile_zip.py SRC DST MODE
MODE:
  tensor-bomb  every tensor record deflated and padded with zeros to 128 MiB: a ~0.2 MB file that
               inflates to 128 MiB per tensor (torch.save never compresses tensors)
  pickle-bomb  data.pkl deflated and padded with 100 MiB of zeros (more than the 64 MiB Shoal inflates)
  weight-bomb  the first tensor record deflated and padded with zeros to 1 GiB: a ~1 MB file (a
               TorchScript model's weights, say) that a reader inflating it takes a gigabyte for
Only the standard library is used, so this runs without PyTorch.
"""
import sys
import zipfile

MIB = 1 << 20


def copy(src, dst, mode):
    bombed = False
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", compresslevel=1) as zout:
        for info in zin.infolist():
            data = zin.read(info)
            record = info.filename.split("/", 1)[1]
            pad = 0
            if mode == "tensor-bomb" and record.startswith("data/"):
                pad = 128 * MIB - len(data)
            if mode == "pickle-bomb" and record == "data.pkl":
                pad = 100 * MIB
            if mode == "weight-bomb" and record.startswith("data/") and not bombed:
                pad = 1024 * MIB - len(data)
                bombed = True
            if pad <= 0:
                zout.writestr(info, data)
                continue
            out = zipfile.ZipInfo(info.filename)
            out.compress_type = zipfile.ZIP_DEFLATED
            with zout.open(out, "w", force_zip64=True) as f:
                f.write(data)
                zeros = bytes(MIB)
                while pad > 0:
                    f.write(zeros[: min(pad, MIB)])
                    pad -= MIB


if __name__ == "__main__":
    copy(sys.argv[1], sys.argv[2], sys.argv[3])
    print("ORACLE OK hostile_zip " + sys.argv[3], flush=True)  # the C++ side requires this line
