// The pickle opcodes torch.save writes and Shoal reads (CPython's pickle protocols 2 to 5).
//
// Thread safety: constants only.
#pragma once

#include <cstdint>

namespace shoal::checkpoint::detail::op {

constexpr uint8_t kMark = '(';
constexpr uint8_t kStop = '.';
constexpr uint8_t kPop = '0';
constexpr uint8_t kPopMark = '1';
constexpr uint8_t kDup = '2';
constexpr uint8_t kBinInt = 'J';
constexpr uint8_t kBinInt1 = 'K';
constexpr uint8_t kBinInt2 = 'M';
constexpr uint8_t kNone = 'N';
constexpr uint8_t kBinPersId = 'Q';
constexpr uint8_t kReduce = 'R';
constexpr uint8_t kBinString = 'T';
constexpr uint8_t kShortBinString = 'U';
constexpr uint8_t kBinUnicode = 'X';
constexpr uint8_t kAppend = 'a';
constexpr uint8_t kBuild = 'b';
constexpr uint8_t kGlobal = 'c';
constexpr uint8_t kDict = 'd';
constexpr uint8_t kEmptyDict = '}';
constexpr uint8_t kAppends = 'e';
constexpr uint8_t kBinGet = 'h';
constexpr uint8_t kLongBinGet = 'j';
constexpr uint8_t kList = 'l';
constexpr uint8_t kEmptyList = ']';
constexpr uint8_t kBinPut = 'q';
constexpr uint8_t kLongBinPut = 'r';
constexpr uint8_t kSetItem = 's';
constexpr uint8_t kTuple = 't';
constexpr uint8_t kEmptyTuple = ')';
constexpr uint8_t kSetItems = 'u';
constexpr uint8_t kBinFloat = 'G';
constexpr uint8_t kProto = 0x80;
constexpr uint8_t kNewObj = 0x81;
constexpr uint8_t kTuple1 = 0x85;
constexpr uint8_t kTuple2 = 0x86;
constexpr uint8_t kTuple3 = 0x87;
constexpr uint8_t kNewTrue = 0x88;
constexpr uint8_t kNewFalse = 0x89;
constexpr uint8_t kLong1 = 0x8a;
constexpr uint8_t kLong4 = 0x8b;
constexpr uint8_t kBinBytes = 'B';
constexpr uint8_t kShortBinBytes = 'C';
constexpr uint8_t kShortBinUnicode = 0x8c;
constexpr uint8_t kBinUnicode8 = 0x8d;
constexpr uint8_t kBinBytes8 = 0x8e;
constexpr uint8_t kStackGlobal = 0x93;
constexpr uint8_t kMemoize = 0x94;
constexpr uint8_t kFrame = 0x95;

}  // namespace shoal::checkpoint::detail::op
