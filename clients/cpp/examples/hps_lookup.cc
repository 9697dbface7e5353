// hps_lookup: look keys up with hps::Client and print the answer as `hps lookup --json` does, byte for byte:
//   {"model": ..., "table": ..., "dim": ..., "keys": [...], "vectors": [[...]], "sources": [...]}
// On a failed call it prints "error: CODE: message" to stderr and exits 1 (2 for a bad command line).
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <system_error>
#include <vector>

#include "hps/client.h"

namespace {

const char kUsage[] =
    "usage: hps_lookup [--timeout SECONDS] [--model-version N] [--label NAME] TARGET MODEL TABLE [--] KEY...\n"
    "Look KEYs (int64) up in TABLE of MODEL on the server at TARGET (host:port) and print the rows as JSON.\n"
    "  --timeout SECONDS  the call's deadline (default 5)\n"
    "  --model-version N  read this version of the model (default: the version its label production names,\n"
    "                     else the model as configured)\n"
    "  --label NAME       read the version this label of the model names\n";

const char* const kCodeNames[] = {"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED",
                                  "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED",
                                  "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL",
                                  "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"};

int Usage(const std::string& problem) {
  std::cerr << "error: " << problem << "\n" << kUsage;
  return 2;
}

bool ParseInt64(const std::string& text, std::int64_t* value) {
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, *value);
  return ec == std::errc() && ptr == end && !text.empty();
}

// A JSON string as Python's json.dumps writes it (ensure_ascii: every character outside ' '..'~' escaped).
std::string JsonString(const std::string& text) {
  std::string out = "\"";
  char escape[16];
  for (std::size_t i = 0; i < text.size(); ++i) {
    unsigned char c = static_cast<unsigned char>(text[i]);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else if (c == '\n' || c == '\r' || c == '\t' || c == '\b' || c == '\f') {
      out += c == '\n' ? "\\n" : c == '\r' ? "\\r" : c == '\t' ? "\\t" : c == '\b' ? "\\b" : "\\f";
    } else {
      std::uint32_t code = c;
      int more = c >= 0xf0 ? 3 : c >= 0xe0 ? 2 : c >= 0xc0 ? 1 : 0;  // a UTF-8 sequence's continuation bytes
      if (more > 0 && i + more < text.size()) {
        code = c & (0x3f >> more);
        for (int k = 1; k <= more; ++k) code = (code << 6) | (static_cast<unsigned char>(text[i + k]) & 0x3f);
        i += more;
      }
      if (code >= 0x10000) {  // a surrogate pair, as Python writes characters outside the BMP
        code -= 0x10000;
        std::snprintf(escape, sizeof escape, "\\u%04x\\u%04x", 0xd800 + (code >> 10), 0xdc00 + (code & 0x3ff));
      } else {
        std::snprintf(escape, sizeof escape, "\\u%04x", code);
      }
      out += escape;
    }
  }
  return out + "\"";
}

// A float32 as Python prints float(value): the shortest digits that read back to the same double, in fixed
// notation with a ".0" when whole, or as "1e-05" / "1.5e+16" outside 1e-4 <= |x| < 1e16; json.dumps' names for
// the non-finite.
std::string PythonFloat(float value) {
  const double x = value;
  if (std::isnan(x)) return "NaN";
  if (std::isinf(x)) return x > 0 ? "Infinity" : "-Infinity";
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, x, std::chars_format::scientific);
  std::string sci(buf, end);  // e.g. "-1.0000000149011612e-01", "5e+00"
  std::string sign = sci[0] == '-' ? "-" : "";
  std::size_t e = sci.find('e');
  std::string digits;
  for (std::size_t i = sign.size(); i < e; ++i) {
    if (sci[i] != '.') digits += sci[i];
  }
  const int point = std::atoi(sci.c_str() + e + 1) + 1;  // digits = 0.DIGITS x 10^point
  const int n = static_cast<int>(digits.size());
  if (point > -4 && point <= 16) {
    if (point <= 0) return sign + "0." + std::string(-point, '0') + digits;
    if (point >= n) return sign + digits + std::string(point - n, '0') + ".0";
    return sign + digits.substr(0, point) + "." + digits.substr(point);
  }
  std::snprintf(buf, sizeof buf, "e%c%02d", point - 1 < 0 ? '-' : '+', std::abs(point - 1));
  return sign + digits.substr(0, 1) + (n > 1 ? "." + digits.substr(1) : "") + buf;
}

void PrintJson(const std::string& model, const std::string& table, const std::vector<std::int64_t>& keys,
               const hps::Rows& rows) {
  std::string out = "{\"model\": " + JsonString(model) + ", \"table\": " + JsonString(table) +
                    ", \"dim\": " + std::to_string(rows.dim) + ", \"keys\": [";
  for (std::size_t i = 0; i < keys.size(); ++i) out += (i ? ", " : "") + std::to_string(keys[i]);
  out += "], \"vectors\": [";
  for (std::size_t i = 0; i < rows.size(); ++i) {
    out += i ? ", [" : "[";
    for (std::uint32_t j = 0; j < rows.dim; ++j) out += (j ? ", " : "") + PythonFloat(rows.row(i)[j]);
    out += "]";
  }
  out += "], \"sources\": [";
  for (std::size_t i = 0; i < rows.size(); ++i) {
    out += (i ? ", \"" : "\"") + std::string(hps::SourceName(rows.sources[i])) + "\"";
  }
  std::cout << out << "]}\n";
}

}  // namespace

int main(int argc, char** argv) {
  hps::LookupOptions options;
  std::vector<std::string> positional;
  bool options_end = false;  // after "--" every argument is positional
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (options_end || arg.rfind("--", 0) != 0) {
      positional.push_back(arg);  // keys may be negative: "-5" is a key, options start with "--"
    } else if (arg == "--") {
      options_end = true;
    } else if (arg == "--help") {
      std::cout << kUsage;
      return 0;
    } else if (arg == "--timeout" && has_value) {
      char* end = nullptr;
      const double seconds = std::strtod(argv[++i], &end);
      if (*end != '\0' || !(seconds > 0)) return Usage("--timeout takes a number of seconds > 0");
      options.timeout = std::chrono::milliseconds(static_cast<std::int64_t>(std::ceil(seconds * 1000)));
    } else if (arg == "--model-version" && has_value) {
      std::int64_t version = 0;
      if (!ParseInt64(argv[++i], &version) || version < 0 || version > INT32_MAX) {
        return Usage("--model-version takes a version number >= 0");
      }
      if (version > 0) options.version = static_cast<std::uint32_t>(version);  // 0: as `hps lookup`, unset
    } else if (arg == "--label" && has_value) {
      options.label = argv[++i];
    } else {
      return Usage("unknown option or missing value: " + arg);
    }
  }
  if (positional.size() < 4) return Usage("TARGET, MODEL, TABLE and at least one KEY are required");
  std::vector<std::int64_t> keys(positional.size() - 3);
  for (std::size_t i = 3; i < positional.size(); ++i) {
    if (!ParseInt64(positional[i], &keys[i - 3])) return Usage("key '" + positional[i] + "' is not an int64");
  }
  hps::Client client(positional[0]);
  hps::Rows rows;
  const grpc::Status status = client.Lookup(positional[1], positional[2], keys, &rows, options);
  if (!status.ok()) {
    const int code = status.error_code();
    std::cerr << "error: " << (code >= 0 && code <= 16 ? kCodeNames[code] : "UNKNOWN") << ": "
              << status.error_message() << "\n";
    return 1;
  }
  PrintJson(positional[1], positional[2], keys, rows);
  return 0;
}
