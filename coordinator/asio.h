// Boost.Asio, included through here: GCC 12 reports -Wnull-dereference inside Asio's own scheduler code
// (boost/asio/detail/impl/scheduler.ipp, thread_info after inlining) at -O2. That is a false positive in a
// system header, so it is silenced for the Asio headers only; our code keeps the warning.
#pragma once

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wnull-dereference"
#include <boost/asio.hpp>
#pragma GCC diagnostic pop
